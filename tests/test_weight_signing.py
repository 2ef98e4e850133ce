"""Signed weight versions (libs/weights/signing.py) against a real nats-server.

A client that does not hold the trainer's private key publishes, on the real subjects, a
forged snapshot (its own weights, signed by its own key), a forged delta (applicable to what
the workers hold, carrying the real key id and a signature of another version), a replayed
old version (a real signed announcement published again) and an unsigned announcement. A
worker's receiver refuses each before fetching a byte, with the reason on the dead-letter
subject, and then applies the next real version bit-exact; a late joiner never starts from
the replay. The same on a region's relay (hub + leaf node, mirrors); same-host notices; and
a key rotation (two trusted keys).
"""

from __future__ import annotations

import asyncio
import stat
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from apps.cli import main as cli_main
from libs.bus import wire
from libs.bus.connection import Bus, connect_bus
from libs.bus.provision import provision
from libs.bus.publisher import Publisher
from libs.weights.announcements import latest_announcement, latest_snapshot
from libs.weights.encoder import encode, encode_snapshot
from libs.weights.hashing import state_hash
from libs.weights.receiver import ReceiverConfig, WeightReceiver
from libs.weights.relay import RegionalWeightReceiver, prune_region
from libs.weights.same_host import SameHostTakeConfig
from libs.weights.same_host_link import SameHostTaker
from libs.weights.signing import (
    ReplayGuard,
    VersionRefused,
    VersionSigner,
    VersionVerifier,
    generate_key_pair,
)
from libs.weights.tensors import raw_state
from libs.weights.transport import store_chunks
from proto import streams
from proto.messages import DeadLetter, WeightAnnouncement
from proto.same_host import SameHostVersion, same_host_subject, same_host_version_key
from proto.subjects import weights_announce_subject
from services.rollout_worker.settings import RolloutWorkerSettings
from services.weight_broadcaster.settings import WeightBroadcasterSettings
from tests.conftest import wait_for
from tests.signing_support import KEYS, SIGNER, trusting
from tests.test_weight_broadcaster import Harness, assert_bit_exact, harness, trainer_state  # noqa: F401
from tests.test_weight_relay import Relay, leaf_link, relay, servers  # noqa: F401 (fixtures)

IN_PROCESS = trusting(decode_process=False, fetch_timeout_s=5.0)
ATTACKS = ("forged snapshot", "forged delta", "unsigned", "replayed")
WANTED_REASONS = {"forged": 2, "unsigned": 1, "replayed": 1}


# ---- the signature itself ----------------------------------------------------------------


def announcement_of(version: int, signer: VersionSigner | None = None) -> WeightAnnouncement:
    """A real-looking snapshot announcement of small weights, signed by `signer`."""
    manifest, _ = encode_snapshot(raw_state(trainer_state(version)), version=version)
    announcement = WeightAnnouncement(
        version=version, base_version=None, kind="snapshot", manifest=manifest,
        version_hash=manifest.target_hash, snapshot_version=version, chain_length=0,
        model_bytes=1, encoded_bytes=1,
    )  # fmt: skip
    return announcement if signer is None else signer.sign_announcement(announcement, "p")


def refusal(verifier: VersionVerifier, announcement: WeightAnnouncement) -> str | None:
    try:
        verifier.check_announcement(announcement)
    except VersionRefused as exc:
        return exc.reason
    return None


def test_a_signature_covers_every_field_that_identifies_the_version() -> None:
    signed = announcement_of(3, SIGNER)
    verifier = SIGNER.verifier()
    decoded = wire.decode(WeightAnnouncement, wire.encode(signed), None)  # over the wire
    assert verifier.check_announcement(decoded) is True
    manifest = signed.manifest
    chunk = msgspec.structs.replace(manifest.chunks[0], payload_hash="0" * 32)
    tampered = {
        "version": msgspec.structs.replace(signed, version=4),
        "kind": msgspec.structs.replace(signed, kind="delta"),
        "target hash": msgspec.structs.replace(signed, version_hash="0" * 32),
        "policy": msgspec.structs.replace(signed, policy_digest="other"),
        "chunk hash": msgspec.structs.replace(
            signed,
            manifest=msgspec.structs.replace(manifest, chunks=[chunk, *manifest.chunks[1:]]),
        ),
        "tensor entry": msgspec.structs.replace(
            signed, manifest=msgspec.structs.replace(manifest, tensors=manifest.tensors[1:])
        ),
    }
    for what, announcement in tampered.items():
        assert refusal(verifier, announcement) == "forged", what
    assert refusal(verifier, announcement_of(3)) == "unsigned"
    assert refusal(verifier, announcement_of(3, VersionSigner.generate())) == "forged"
    # The worker, once it checked the trainer's policy: another policy's version is refused.
    verifier.expected_policy = "the trainer's"
    assert refusal(verifier, signed) == "forged"


def test_unsigned_versions_are_an_explicit_choice() -> None:
    with pytest.raises(ValueError, match="allow_unsigned"):
        VersionVerifier.from_config([], allow_unsigned=False)
    with pytest.raises(ValueError, match="WEIGHTS_SIGNERS"):
        RolloutWorkerSettings(weights=ReceiverConfig())
    with pytest.raises(ValueError, match="SIGNING_KEY"):
        WeightBroadcasterSettings(signing_key=None)
    RolloutWorkerSettings(weights=ReceiverConfig(allow_unsigned=True))
    WeightBroadcasterSettings(signing_key=None, allow_unsigned=True)
    lenient = VersionVerifier.from_config([KEYS.public_text], allow_unsigned=True)
    assert lenient.check_announcement(announcement_of(2)) is False  # taken, as unsigned
    assert refusal(lenient, announcement_of(2, VersionSigner.generate())) == "forged"


def test_the_replay_guard_refuses_a_version_below_one_announced_before_it() -> None:
    guard = ReplayGuard()
    for seq, version in ((1, 4), (2, 4), (3, 5), (4, 6)):  # delta 4, snapshot 4, deltas
        guard.check(seq, version)
    with pytest.raises(VersionRefused, match="old version published again"):
        guard.check(5, 4)
    guard.check(2, 4)  # read again after a reposition: judged by what came before it
    guard.check(6, 7)


def test_keygen_writes_a_private_key_only_its_owner_reads_and_a_public_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli_main(["weights", "keygen", "--out", str(tmp_path / "k")]) == 0
    out = capsys.readouterr().out
    private, public = tmp_path / "k" / "weights-signing.key", tmp_path / "k" / "weights-signing.pub"
    assert stat.S_IMODE(private.stat().st_mode) == 0o600
    assert public.read_text().startswith("ed25519:") and public.read_text().strip() in out
    signer = VersionSigner.load(private)
    assert f"key id      {signer.key_id}" in out
    for key in (private, public):
        assert cli_main(["weights", "key-id", str(key)]) == 0
        assert capsys.readouterr().out.strip() == signer.key_id
    # A key is never overwritten: a new one goes to a new folder; --keep keeps it (compose).
    assert cli_main(["weights", "keygen", "--out", str(tmp_path / "k")]) == 2
    assert "exists" in capsys.readouterr().err
    assert cli_main(["weights", "keygen", "--out", str(tmp_path / "k"), "--keep"]) == 0
    assert VersionSigner.load(private).key_id == signer.key_id
    split = ["--out", str(tmp_path / "private"), "--public-out", str(tmp_path / "public")]
    assert cli_main(["weights", "keygen", *split]) == 0
    assert not (tmp_path / "private" / "weights-signing.pub").exists()
    assert (tmp_path / "public" / "weights-signing.pub").read_text().startswith("ed25519:")


# ---- attacks on a real bus -----------------------------------------------------------------


class Attacker:
    """A client with bus access and without the trainer's private key."""

    def __init__(self, bus: Bus) -> None:
        self.bus = bus
        self.publisher = Publisher(bus.js)
        self.own_key = VersionSigner.generate()

    async def publish(self, announcement: WeightAnnouncement, chunks: list[Any], n: str) -> None:
        await store_chunks(self.publisher, announcement.manifest, chunks, self.bus.nc.max_payload)
        await self.publisher.publish(
            weights_announce_subject(announcement.kind), announcement, msg_id=f"attack-{n}"
        )

    async def forged_snapshot(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        manifest, chunks = encode_snapshot(raw_state(weights), version=version)
        announcement = self.own_key.sign_announcement(_announcement(manifest, "snapshot"), "")
        await self.publish(announcement, chunks, "forged-snapshot")

    async def forged_delta(
        self, version: int, base: dict[str, torch.Tensor], weights: dict[str, torch.Tensor]
    ) -> None:
        """A delta workers holding `base` could apply, with the real key's id and a real
        signature (of the latest real delta)."""
        real = await latest_announcement(self.bus.js, "delta")
        assert real is not None
        manifest, chunks = encode(
            raw_state(base), raw_state(weights), base_version=version - 1, version=version,
            base_hash=state_hash(raw_state(base)),
        )  # fmt: skip
        announcement = msgspec.structs.replace(
            _announcement(manifest, "delta"), signature=real[1].signature,
            key_id=real[1].key_id, policy_digest=real[1].policy_digest,
        )  # fmt: skip
        await self.publish(announcement, chunks, "forged-delta")

    async def unsigned(self, version: int, weights: dict[str, torch.Tensor]) -> None:
        manifest, chunks = encode_snapshot(raw_state(weights), version=version)
        await self.publish(_announcement(manifest, "snapshot"), chunks, "unsigned")

    async def replay(self, version: int, kind: str = "snapshot") -> None:
        """A real signed announcement of `version` published again, as it was."""
        stream = await self.bus.js.stream_info(streams.WEIGHTS_ANNOUNCE.name)
        for seq in range(stream.state.first_seq, stream.state.last_seq + 1):
            raw = await self.bus.js.get_msg(streams.WEIGHTS_ANNOUNCE.name, seq=seq)
            old = wire.decode(WeightAnnouncement, raw.data or b"", raw.headers)
            if old.version == version and old.kind == kind:
                await self.bus.nc.publish(raw.subject or "", raw.data or b"")
                await self.bus.js.get_msg(streams.WEIGHTS_ANNOUNCE.name, seq=seq)  # (a round trip)
                return
        raise AssertionError(f"no {kind} of version {version} to replay")

    async def all_attacks(self, head: int, base: dict[str, torch.Tensor]) -> None:
        evil = {name: torch.zeros_like(t) for name, t in base.items()}
        await self.forged_snapshot(head + 1, evil)
        await self.forged_delta(head + 1, base, evil)
        await self.unsigned(head + 1, evil)
        await self.replay(1)


def _announcement(manifest: Any, kind: str) -> WeightAnnouncement:
    snapshot = manifest.version if kind == "snapshot" else manifest.version - 1
    return WeightAnnouncement(
        version=manifest.version, base_version=manifest.base_version, kind=kind,  # type: ignore[arg-type]
        manifest=manifest, version_hash=manifest.target_hash, snapshot_version=snapshot,
        chain_length=0 if kind == "snapshot" else 1, model_bytes=1, encoded_bytes=1,
    )  # fmt: skip


async def dead_letter_reasons(bus: Bus, origin: str = "weight-receiver") -> dict[str, int]:
    """Reasons of the weight receivers' dead letters (from the Rlpipe-Dead-Reason header)."""
    info = await bus.js.stream_info(streams.DEAD_LETTERS.name)
    reasons: dict[str, int] = {}
    for seq in range(info.state.first_seq, info.state.last_seq + 1):
        raw = await bus.js.get_msg(streams.DEAD_LETTERS.name, seq=seq)
        letter = wire.decode(DeadLetter, raw.data or b"", raw.headers)
        headers = raw.headers or {}
        if letter.consumer == origin:
            assert headers[wire.DEAD_REASON_HEADER] == letter.reason
            reasons[letter.reason] = reasons.get(letter.reason, 0) + 1
    return reasons


async def next_applied(receiver: WeightReceiver, state: dict[str, Any]) -> int:
    update = await asyncio.wait_for(receiver.next_update(), 20)
    await asyncio.to_thread(receiver.apply, update, state)
    return update.version


async def test_forged_replayed_and_unsigned_versions_are_refused_and_training_goes_on(
    harness: Harness,  # noqa: F811 (the fixture)
    nats_server: Any,
) -> None:
    await harness.stage_until(2)  # snapshot 1, delta 2
    state: dict[str, Any] = {}
    receiver = WeightReceiver(harness.bus, IN_PROCESS)
    attacker = Attacker(await connect_bus(nats_server.url, name="attacker"))
    try:
        assert [await next_applied(receiver, state) for _ in range(2)] == [1, 2]
        await attacker.all_attacks(2, harness.versions[2])
        await harness.stage_until(3)
        # Four announcements refused before a byte was fetched; the real version 3 applied.
        assert await next_applied(receiver, state) == 3
        assert_bit_exact(state, harness.versions[3])
        assert receiver.num_refused == len(ATTACKS)
        await wait_for(
            lambda: _reasons_are(harness.bus, WANTED_REASONS), 10, "the refusals dead-lettered"
        )
        # A worker starting now starts from the real snapshot, not the replayed one, and
        # takes the real chain (version 4, a snapshot point, is after the attacks too).
        announce = streams.WEIGHTS_ANNOUNCE.name
        start = await latest_snapshot(harness.bus.js, announce, SIGNER.verifier())
        assert start is not None and start[1].version == 1 and start[1].key_id == SIGNER.key_id
        await harness.stage_until(4)
        late: dict[str, Any] = {}
        joiner = WeightReceiver(harness.bus, IN_PROCESS)
        try:
            await joiner.catch_up(late, version=4, timeout_s=20)
        finally:
            await joiner.close()
        assert_bit_exact(late, harness.versions[4])
        assert await next_applied(receiver, state) == 4
    finally:
        await receiver.close()
        await attacker.bus.close()


async def _reasons_are(bus: Bus, wanted: dict[str, int]) -> bool:
    return await dead_letter_reasons(bus) == wanted


async def test_a_replayed_delta_is_refused(harness: Harness) -> None:  # noqa: F811
    """A delta copied and published again after newer versions: a worker catching up
    refuses it as a replay and reaches the real head."""
    await harness.stage_until(5)  # snapshot 4: the stream starts at delta 4
    attacker = Attacker(harness.bus)
    await attacker.replay(4, kind="delta")
    await harness.stage_until(6)
    state: dict[str, Any] = {}
    receiver = WeightReceiver(harness.bus, IN_PROCESS)
    try:
        await receiver.catch_up(state, version=6, timeout_s=20)
        assert_bit_exact(state, harness.versions[6])
        assert receiver.num_refused == 1
    finally:
        await receiver.close()
    assert await dead_letter_reasons(harness.bus) == {"replayed": 1}


async def test_a_version_signed_with_a_new_key_is_taken_where_both_keys_are_trusted(
    bus: Bus, tmp_path: Path
) -> None:
    """Rotation: workers trust the old and the new public key, then the broadcaster
    switches to the new private key (and starts a new chain from a snapshot: it trusts its
    own key only); a worker still trusting the old key only refuses the new versions."""
    new = generate_key_pair(tmp_path / "new")
    await provision(bus.js)
    chain = Harness(bus, tmp_path / "staging")
    both_keys = ReceiverConfig(signers=[KEYS.public_text, str(new.public_path)],
                               decode_process=False)  # fmt: skip
    both, old_only = WeightReceiver(bus, both_keys), WeightReceiver(bus, IN_PROCESS)
    held: dict[str, Any] = {}
    stuck: dict[str, Any] = {}
    try:
        await chain.start_broadcaster()
        await chain.stage_until(1)  # signed with the session's (old) key
        assert await next_applied(both, held) == 1 == await next_applied(old_only, stuck)
        await chain.stop_broadcaster()
        chain.settings = {"signing_key": new.private_path}
        await chain.start_broadcaster()
        await chain.stage_until(2)
        head = await latest_announcement(bus.js, "snapshot")
        assert head is not None and head[1].version == 2
        assert head[1].key_id == new.key_id != SIGNER.key_id
        assert await next_applied(both, held) == 2
        assert_bit_exact(held, chain.versions[2])
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(old_only.next_update(), 2)
        assert old_only.num_refused == 1 and both.num_refused == 0
    finally:
        await both.close()
        await old_only.close()
        if chain.service is not None:
            await chain.stop_broadcaster()


# ---- a region's relay ----------------------------------------------------------------------


async def test_a_relay_refuses_what_the_hub_was_sent_and_prunes_by_real_snapshots_only(
    relay: Relay,  # noqa: F811 (the fixture)
) -> None:
    """Mirrors copy whatever the hub holds: the regional receiver refuses the attacks with
    the reason on the dead-letter subject (a JetStream publish from the region, stored by
    the hub's stream over the leaf link), applies the next real version, and relay-prune
    purges by the real snapshot, not a forged one of a higher version."""
    await provision(relay.hub_bus.js, stream_specs=(streams.DEAD_LETTERS,), consumer_specs=(),
                    kv_specs=())  # fmt: skip
    await relay.publish_until(2)
    await relay.wait_mirrored()
    bus = await connect_bus(relay.region.url, name="pytest-region-worker")
    receiver = RegionalWeightReceiver(bus, trusting(decode_process=False, fetch_timeout_s=5.0))
    attacker = Attacker(relay.hub_bus)
    state: dict[str, Any] = {}
    try:
        assert [await next_applied(receiver, state) for _ in range(2)] == [1, 2]
        await attacker.all_attacks(2, relay.versions[2])
        await relay.publish_until(3)
        await relay.wait_mirrored()
        assert await next_applied(receiver, state) == 3
        assert_bit_exact(state, relay.versions[3])
        assert receiver.num_refused == len(ATTACKS)
        await wait_for(lambda: _reasons_are(relay.hub_bus, WANTED_REASONS), 10, "dead letters")
        # The forged snapshot (version 3, attacker's key) is the last snapshot by subject;
        # pruning by it would purge the real chain. Snapshot 1 is the real one: kept.
        kept = await prune_region(relay.region_bus.js, SIGNER.verifier())
        assert kept is not None and kept.snapshot_version == 1
        await relay.publish_until(4)  # a real snapshot point
        await relay.wait_mirrored()
        kept = await prune_region(relay.region_bus.js, SIGNER.verifier())
        assert kept is not None and kept.snapshot_version == 4
        assert await next_applied(receiver, state) == 4
    finally:
        await receiver.close()
        await bus.close()
    assert leaf_link(relay.region)


# ---- same-host notices ----------------------------------------------------------------------


async def test_a_forged_same_host_notice_is_refused(bus: Bus) -> None:
    """Notices published on the host's subject or written to the bucket by anyone without
    the trainer's key are never offered to the worker; the trainer's signed one is."""
    await provision(bus.js)
    host = "host-sign"
    verifier = VersionVerifier.from_config([KEYS.public_text], allow_unsigned=False)
    taker = SameHostTaker(bus, SameHostTakeConfig(host_id=host), verifier)
    await taker.start()
    try:
        notice = SameHostVersion(shelf_id="shelf", version=5, slot=0, checksum=7)
        forged = VersionSigner.generate().sign_same_host(notice, "")
        tampered = msgspec.structs.replace(SIGNER.sign_same_host(notice, ""), checksum=8)
        for bad in (notice, forged, tampered):
            await bus.nc.publish(same_host_subject(host), wire.encode(bad))
        kv = await bus.js.key_value(streams.STATE.bucket)
        await kv.put(same_host_version_key(host), wire.encode(forged))
        await bus.nc.flush()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(taker.next_notice(after=None), 1.5)  # polls the bucket too
        real = SIGNER.sign_same_host(msgspec.structs.replace(notice, version=4), "")
        await bus.nc.publish(same_host_subject(host), wire.encode(real))
        taken = await asyncio.wait_for(taker.next_notice(after=None), 5)
        assert taken.version == 4 and taken.signature == real.signature
    finally:
        await taker.close()
