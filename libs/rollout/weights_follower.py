"""Keep an inference engine on the newest policy version of the bus, swapping in place.

    follower = WeightsFollower(engine, WeightReceiver(bus, ReceiverConfig()), batcher)
    await follower.start(bus.js)                 # notes the newest version announced now
    asyncio.create_task(follower.run())          # fetch, verify, apply, forever
    await follower.wait_caught_up()              # holds that version (or the first one)
    await follower.wait_for_version(7)           # the synchronous baseline's wait

Each version is fetched and verified by the receiver while the engine keeps generating,
then decoded against the live weights (still generating: decoding only reads them). Only
then does the follower take the batcher's gate (no new generate call starts; the running one
finishes first) and write: on a CPU engine straight into the model's parameters through
`engine.write_in_place` (the receiver's state is the engine's `live_tensors()`, which share
storage with the parameters, so nothing is copied twice and the parameters keep their
storage); otherwise (weights on a GPU, or not exposed) into a CPU shadow copy, whose changed
tensors then go through `engine.update_weights`. The pause is the time the engine
was locked for the write, and is exported. An engine that swaps between decode steps (the
paged engine, `swaps_between_steps`) is written in place without the gate: its running calls
go on with the new weights instead of finishing on the old ones first, so a long turn
neither pins an old policy nor holds the swap back.

A version that cannot be had intact (MissingChunkError, CorruptDeltaError) or does not fit
(BaseMismatchError, or it names tensors the model lacks) is logged loudly and never written;
after a growing delay the receiver reads it again (a damaged or timed-out read, a few times)
or moves on (to the next snapshot), so a bad version is not refetched in a tight loop.
Should the whole-state check fail after a write (the weights were changed outside the
receiver), generation stops (`batcher.open` cleared, status "waiting for weights") until a
snapshot has been applied.

Health: while it follows, the follower polls the newest version it should take every
`LAG_POLL_S` (the newest announced; for promoted versions only, the promoted one);
`problem()` says why the worker is stuck when a newer version than the engine holds (or any,
while it holds none) has been available for over `WEIGHTS_STALL_S` without one being
applied, with the last failure's reason (libs/work_health.py).

Promoted versions only (the receiver's `config.promoted_only`, for replicas serving product
users): the engine takes a version only once the trainer's eval gate promoted it (KV key
PROMOTED_VERSION_KEY of the state bucket, polled every `promoted_poll_s`). The chain is
followed into a CPU shadow copy up to the promoted version (deltas apply in order, so the
versions between promotions are applied to the shadow, never served), then the tensors
changed since the last push go to the engine through `engine.update_weights` in one pause. A
shadow that skipped past the promoted version (a gap repaired from a newer snapshot) waits
for the next promotion. Costs one CPU copy of the weights; needs the trainer's gate on.

On the trainer's host (`same_host`, libs/weights/same_host_link.py) the engine takes each
version straight from the trainer's memory instead: the slot is copied into the live weights
in the pause (milliseconds on a card), with no fetch or decode. While versions come that way
the delta chain is not followed (its next delta would start from a version the engine no
longer holds); when none came for `fallback_after_s` while the chain announces a newer one,
the receiver starts over from the chain's next snapshot above what the engine holds (older
versions of the chain are skipped, never written back).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import nats.errors
import structlog
import torch
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from prometheus_client import Counter, Gauge

from libs.engine.base import InferenceEngine
from libs.rollout.batcher import GenerationBatcher
from libs.rollout.version_book import VersionBook
from libs.rollout.weight_states import changed_tensors, state_for, writable_on_host
from libs.weights.announcements import latest_announcement
from libs.weights.errors import CorruptDeltaError, WeightsError
from libs.weights.format import VersionInfo
from libs.weights.receiver import PreparedUpdate, WeightReceiver
from libs.weights.same_host import ChecksumMismatchError, TornCopyError
from libs.weights.same_host_link import SameHostTaker
from libs.weights.signing import VersionVerifier
from libs.work_health import LagWatch
from proto import streams

log = structlog.get_logger(__name__)
T = TypeVar("T")

POLICY_VERSION = Gauge("rlpipe_rollout_policy_version", "Policy version the engine generates with")
SWAP_PAUSE_SECONDS = Gauge(
    "rlpipe_rollout_weight_swap_pause_seconds",
    "Time generation was paused for the latest weight swap",
)
SWAPS = Counter("rlpipe_rollout_weight_swaps_total", "Weight versions swapped into the engine")
SWAP_FAILURES = Counter(
    "rlpipe_rollout_weight_swap_failures_total", "Weight versions refused or failed", ["reason"]
)

DEFAULT_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 5.0, 10.0, 30.0)
# A worker with no new weights this long while a newer version is announced is unhealthy:
# far above a version's fetch and apply on the links we measured (docs/weights-relay.md).
WEIGHTS_STALL_S = 180.0
LAG_POLL_S = 5.0


async def latest_announced_version(
    js: JetStreamContext, verifier: VersionVerifier, stream: str = streams.WEIGHTS_ANNOUNCE.name
) -> int | None:
    """The newest version announced on the bus (delta or snapshot) that `verifier` trusts,
    or None."""
    kinds = ("delta", "snapshot")
    found = [await latest_announcement(js, kind, stream, verifier) for kind in kinds]
    versions = [announcement.version for _, announcement in filter(None, found)]
    return max(versions, default=None)


async def read_promoted_version(js: JetStreamContext) -> int | None:
    """The version the trainer's eval gate last promoted, or None before any promotion."""
    kv = await js.key_value(streams.STATE.bucket)
    try:
        entry = await kv.get(streams.PROMOTED_VERSION_KEY)
    except KeyNotFoundError:
        return None
    return int(entry.value.decode()) if entry.value else None


class WeightsFollower:
    """Applies every version the receiver delivers to `engine`, between generate calls."""

    def __init__(
        self,
        engine: InferenceEngine,
        receiver: WeightReceiver,
        batcher: GenerationBatcher,
        *,
        retry_delays_s: tuple[float, ...] = DEFAULT_RETRY_DELAYS_S,
        promoted_poll_s: float = 1.0,
        same_host: SameHostTaker | None = None,
    ) -> None:
        self.engine = engine
        self.receiver = receiver
        self._trusted = receiver.verifier  # what the newest announced version is read with
        self.batcher = batcher
        self.retry_delays_s = retry_delays_s
        self.promoted_only = promoted_only = receiver.config.promoted_only
        self.promoted_poll_s = promoted_poll_s
        live = engine.live_tensors()
        # Promoted-only needs the shadow: versions between promotions must not reach the model.
        in_place = writable_on_host(live) and not promoted_only
        self._host: dict[str, torch.Tensor] | None = live if in_place else None
        self._js: JetStreamContext | None = None
        self._unpushed: set[str] = set()  # shadow tensors changed since the last push
        # What the receiver writes into: a subset of the host tensors, or a CPU shadow.
        self._state: dict[str, Any] = {}
        self.usable = False  # the engine holds a complete, verified version
        self.last_pause_s: float | None = None
        self.num_applied = 0
        self.num_failed = 0
        self.target_version: int | None = None
        self.versions = VersionBook()  # the versions applied: number -> manifest hash
        self._changed = asyncio.Event()
        self._announce_js: JetStreamContext | None = None
        self.lag = LagWatch("weights", limit_s=WEIGHTS_STALL_S)
        self.last_error = ""
        # Versions from the trainer's memory (never for promoted-only replicas: they take
        # promoted versions, not every one).
        self.same_host = None if promoted_only else same_host
        self._write_lock = asyncio.Lock()  # one writer at a time: the chain or same-host
        self.promotions = asyncio.Lock()  # held by a loan: no promotion taken (libs/fleet)
        self._chain_parked = False  # the receiver's chain left behind by same-host versions

    @property
    def in_place(self) -> bool:
        """True when versions are written straight into the model's parameters."""
        return self._host is not None

    @property
    def policy_version(self) -> int | None:
        """Version the engine generates with; None until one was applied."""
        return self.engine.policy_version if self.usable else None

    async def start(self, js: JetStreamContext, state_js: JetStreamContext | None = None) -> None:
        """Note the newest version announced (or promoted) now: `wait_caught_up` waits for it.

        `js` holds the announcements (a region's relay server, docs/weights-relay.md);
        `state_js` the trainer's KV state with the promoted version (default: `js`)."""
        self._js = state_js or js
        self._announce_js = js
        if self.promoted_only:
            self.target_version = await read_promoted_version(self._js)
        else:
            self.target_version = await latest_announced_version(js, self._trusted)
        log.info(
            "following weights",
            target_version=self.target_version,
            in_place=self.in_place,
            promoted_only=self.promoted_only,
        )

    async def run(self) -> None:
        """Fetch and apply versions (or only promoted ones), and watch the lag behind the
        announcements, until cancelled."""
        async with asyncio.TaskGroup() as group:
            group.create_task(self._follow())
            group.create_task(self._watch_lag())
            if self.same_host is not None:
                await self.same_host.start()
                group.create_task(self._follow_same_host())

    def problem(self) -> str | None:
        """Why the engine is stuck behind the announced versions, or None."""
        problem = self.lag.problem(time.monotonic())
        if problem is not None and self.last_error:
            problem += f"; last failure: {self.last_error}"
        return problem

    async def _watch_lag(self) -> None:
        """Compare what the engine holds with the newest version it should take, every
        LAG_POLL_S."""
        while True:
            try:
                available = await self.newest_available()
            except (nats.errors.Error, TimeoutError) as exc:
                log.warning("cannot read the newest available version", error=repr(exc))
            else:
                self.lag.observe(self.policy_version, available, time.monotonic())
            await asyncio.sleep(LAG_POLL_S)

    async def newest_available(self) -> int | None:
        """The newest version this engine should take: the promoted one for a promoted-only
        replica (the trainer's newer versions are not for it), else the newest announced."""
        assert self._announce_js is not None and self._js is not None, "start() first"
        if self.promoted_only:
            return await read_promoted_version(self._js)
        return await latest_announced_version(self._announce_js, self._trusted)

    async def _follow(self) -> None:
        failures = 0
        while True:
            try:
                if self.promoted_only:
                    await self._serve_next_promotion()
                    continue
                if self.same_host is not None:
                    await self._while_same_host_serves()
                update = await self.receiver.next_update()
                await self.apply(update)
            except (WeightsError, ValueError) as exc:
                failures += 1
                await self._on_failure(exc, failures)
                continue
            failures = 0

    async def apply(self, update: PreparedUpdate) -> float:
        """Verify and decode `update` off the lock, then write it; returns the pause in s
        (0.0 for a version of the chain older than a same-host one the engine holds)."""
        if self._behind_same_host(update.version):
            return 0.0
        state = state_for(update, self._host, self._state)
        started_s = time.monotonic()
        taken = self.same_host.num_applied if self.same_host is not None else 0
        await asyncio.to_thread(self.receiver.decode, update, state)  # generation goes on
        decoded_s = time.monotonic()
        async with self._write_lock, self._swap_gate():
            if self.same_host is not None and self.same_host.num_applied != taken:
                # Decoded against weights a same-host version has since replaced.
                self._chain_parked = True  # the engine holds a version off the chain
                return 0.0
            # Entered once the engine calls running now have finished (gate_wait_s).
            gate_wait_s = time.monotonic() - decoded_s
            try:
                pause_s = await self._write(update, state)
            except CorruptDeltaError:
                self._set_unusable()
                raise
        self._state = state
        timings = {
            "decode_s": decoded_s - started_s,
            "decode_chunk_wall_s": update.chunk_wall_s,
            "decode_chunk_cpu_s": update.chunk_cpu_s,
            "gate_wait_s": gate_wait_s,
        }
        self.versions.record(update.version, update.announcement.version_hash)
        self._swapped(update.version, update.kind, pause_s, timings)
        return pause_s

    def _swapped(
        self, version: int, kind: str, pause_s: float, timings: dict[str, float] | None = None
    ) -> None:
        """The engine now generates with `version`: open the gate, export, tell waiters."""
        self.usable = True
        self.batcher.open.set()
        self.last_error = ""
        self.last_pause_s = pause_s
        self.num_applied += 1
        POLICY_VERSION.set(version)
        SWAP_PAUSE_SECONDS.set(pause_s)
        SWAPS.inc()
        log.info(
            "weights swapped",
            version=version,
            kind=kind,
            pause_s=round(pause_s, 6),
            in_place=self.in_place,
            **{name: round(value, 4) for name, value in (timings or {}).items()},
        )
        self._notify()

    # ---- versions from the trainer's memory ------------------------------------------------

    async def _follow_same_host(self) -> None:
        """Copy each version the host's trainer shares into the engine, newest first."""
        taker = self.same_host
        assert taker is not None
        failures = 0
        while True:
            notice = await taker.next_notice(after=self.policy_version)
            reader = await taker.reader_for(notice)
            if reader is None:
                await asyncio.sleep(self.retry_delays_s[0])  # the next notice may be mappable
                continue
            live = self.engine.live_tensors()
            assert live is not None, "same-host needs the engine's live tensors"
            copy = functools.partial(reader.copy_into, live, notice, taker.config.verify)
            waited_s = time.monotonic()
            async with self._write_lock, self._swap_gate():
                waited_s = time.monotonic() - waited_s
                try:
                    _, pause_s = await asyncio.to_thread(self._write_live, copy, notice.version)
                except (TornCopyError, ChecksumMismatchError, ValueError) as exc:
                    # The weights may be half written: nothing generates until a whole copy.
                    self._set_unusable()
                    failures += 1
                    await self._on_failure(exc, failures)
                    continue
            failures = 0
            taker.applied()
            self._chain_parked = True  # the engine holds a version off the chain
            self._swapped(
                notice.version,
                "same_host",
                pause_s,
                {
                    "gate_wait_s": waited_s,
                    "since_published_s": time.time() - notice.published_at,
                },
            )

    async def _while_same_host_serves(self) -> None:
        """Return once the chain is the way to follow: same-host versions never came, or
        none came for `fallback_after_s` while the chain announces a newer version (then
        the receiver starts over from a snapshot above the engine's version)."""
        taker = self.same_host
        assert taker is not None and self._announce_js is not None
        while self._chain_parked:
            quiet_s = taker.quiet_for(time.monotonic())
            if quiet_s is not None and quiet_s > taker.config.fallback_after_s:
                announced = await latest_announced_version(self._announce_js, self._trusted)
                if announced is not None and announced > (self.policy_version or -1):
                    log.warning("no same-host version for a while: following the delta chain",
                                quiet_s=round(quiet_s, 1), announced=announced,
                                held=self.policy_version)  # fmt: skip
                    self._chain_parked = False
                    # The version held, off the chain (its chain hash unknown): the receiver
                    # reads the chain again from its latest snapshot, skips it up to that
                    # version and takes the first snapshot above it.
                    held = self.policy_version
                    self.receiver.reset(
                        None if held is None else VersionInfo(version=held, hash="")
                    )
                    await self.receiver.reread()
                    return
            # What the chain announces meanwhile is read and checked (a bad announcement is
            # dead-lettered as ever), not fetched.
            await self.receiver.pass_over(wait_s=1.0)

    def _behind_same_host(self, version: int) -> bool:
        """True for a chain version at or below a same-host version the engine holds."""
        taken = self.same_host is not None and self.same_host.num_applied > 0
        return taken and self.usable and version <= self.engine.policy_version

    # ---- promoted versions only -------------------------------------------------------------

    async def _serve_next_promotion(self) -> None:
        """Wait for a promotion, follow the chain up to it in the shadow, then swap it in."""
        promoted = await self._next_promotion()
        async with self.promotions:
            if not self._wants(promoted):  # the replica was lent meanwhile
                return
            while self._shadow_version() < promoted:
                await self._apply_to_shadow(await self.receiver.next_update())
            if self._shadow_version() == promoted:
                await self._push_shadow(promoted)

    def promoted_copy(self) -> tuple[VersionInfo, dict[str, Any]] | None:
        """The promoted version the engine serves and its host copy (the shadow); None
        unless the engine holds just what the shadow does (a loan restores from it)."""
        held = self.receiver.current
        if not (self.promoted_only and self.usable) or held is None or self._unpushed:
            return None
        return (held, self._state) if held.version == self.engine.policy_version else None

    def _shadow_version(self) -> int:
        current = self.receiver.current
        return -1 if current is None or current.version is None else current.version

    async def _next_promotion(self) -> int:
        """A promoted version the engine lacks and the shadow has not passed (polls the KV)."""
        assert self._js is not None, "start() first"
        while True:
            promoted = await read_promoted_version(self._js)
            if promoted is not None and self._wants(promoted):
                return promoted
            await asyncio.sleep(self.promoted_poll_s)

    def _wants(self, promoted: int) -> bool:
        newer = not self.usable or promoted > self.engine.policy_version
        return newer and promoted >= self._shadow_version()

    async def _apply_to_shadow(self, update: PreparedUpdate) -> None:
        state = state_for(update, self._host, self._state)
        await asyncio.to_thread(self.receiver.apply, update, state)
        self._unpushed |= set(changed_tensors(update, state))
        self._state = state

    async def _push_shadow(self, version: int) -> None:
        """Hand the shadow's changed tensors to the engine as `version` (the gate held)."""
        changed = {name: self._state[name] for name in sorted(self._unpushed)}
        async with self.batcher.gate:
            try:
                pause_s = await asyncio.to_thread(self.engine.update_weights, changed, version)
            except ValueError:
                self.receiver.reset(None)  # start over from a snapshot
                self._state.clear()
                self._unpushed.clear()
                raise
        self._unpushed.clear()
        self.versions.record(version, _hash_of(self.receiver.current, version))
        self._swapped(version, "promoted", pause_s)

    async def _write(self, update: PreparedUpdate, state: dict[str, Any]) -> float:
        """Write the decoded update (the gate held); the engine's pause in seconds."""
        if self._host is not None:
            _, pause_s = await asyncio.to_thread(
                self._write_live, lambda: self.receiver.apply(update, state), update.version
            )
            return pause_s
        await asyncio.to_thread(self.receiver.apply, update, state)
        changed = changed_tensors(update, state)
        try:
            return await asyncio.to_thread(self.engine.update_weights, changed, update.version)
        except ValueError:
            # The shadow holds the version, the engine does not: start over from a snapshot.
            self.receiver.reset(None)
            state.clear()
            raise

    @property
    def _between_steps(self) -> bool:
        """Written in place between decode steps, under running calls (see the docstring)."""
        return self.in_place and self.engine.swaps_between_steps

    def _swap_gate(self) -> contextlib.AbstractAsyncContextManager[object]:
        """The batcher's gate (no call starts, the running ones finish first), or nothing
        where the engine swaps between decode steps."""
        return contextlib.nullcontext() if self._between_steps else self.batcher.gate

    def _write_live(self, write: Callable[[], T], version: int) -> tuple[T, float]:
        """Run `write` on the live weights as `version` (blocking): between decode steps
        where the engine can, else while no call runs."""
        if self._between_steps:
            return self.engine.write_between_steps(write, version)
        return self.engine.write_in_place(write, version)

    def use_loaded_weights(self) -> None:
        """Generate with the weights the engine was built with and follow nothing (a fixed
        judge or baseline replica): version `engine.policy_version` from now on."""
        self.usable = True
        self.batcher.open.set()
        POLICY_VERSION.set(self.engine.policy_version)
        log.info("serving the loaded weights; not following", version=self.engine.policy_version)
        self._notify()

    def _set_unusable(self) -> None:
        self.usable = False
        self.batcher.open.clear()
        self._notify()

    async def _on_failure(self, exc: Exception, failures: int) -> None:
        self.num_failed += 1
        reason = type(exc).__name__
        self.last_error = f"{reason}: {exc}"
        SWAP_FAILURES.labels(reason).inc()
        delay_s = self.retry_delays_s[min(failures, len(self.retry_delays_s)) - 1]
        log.error(
            "weight version NOT applied; continuing from the next usable version",
            reason=reason,
            error=str(exc),
            held=self.engine.policy_version,
            usable=self.usable,
            retry_in_s=delay_s,
        )
        await asyncio.sleep(delay_s)

    def _notify(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def has_version(self, version: int) -> bool:
        """True when the engine holds a usable version >= `version`."""
        return self.usable and self.engine.policy_version >= version

    async def wait_for_version(self, version: int) -> None:
        """Until the engine generates with a usable version >= `version`."""
        while not self.has_version(version):
            await self._changed.wait()

    async def wait_caught_up(self) -> None:
        """Until the engine holds the version that was newest at `start` (or any version,
        when none was announced then)."""
        await self.wait_for_version(self.target_version or 0)


def _hash_of(held: VersionInfo | None, version: int) -> str:
    """The hash of `version` where `held` (what the receiver holds) is that version."""
    return held.hash if held is not None and held.version == version else ""
