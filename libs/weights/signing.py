"""Signed weight versions: the trainer's side signs what it announces, receivers verify.

    signer = VersionSigner.load("weights-signing.key")          # the weight-broadcaster, trainer
    announcement = signer.sign_announcement(announcement, policy_digest)
    verifier = VersionVerifier.from_config(["weights-signing.pub"], allow_unsigned=False)
    verifier.check_announcement(announcement)                   # VersionRefused, or True

Checksums (XXH3 in the manifest) catch corruption, not forgery: whoever can publish on the
bus can announce a version with matching hashes. An ed25519 signature by a key only the
trainer's side holds makes the manifest trustworthy, and the manifest already pins every
chunk (its payload hash, checked per chunk) and the whole state (the target hash, checked
after the swap), so the signature covers a few KB, not the weights.

What is signed (`VersionClaim`, a msgpack array, after the DOMAIN prefix): what the message
is (an announcement or a same-host notice), the key id, the policy digest, the version, its
base version and base hash, the kind, the target hash, every chunk's payload hash, and a
SHA-256 of the whole manifest as msgpack (tensor entries, chunk sizes and names included).
A same-host notice signs its shelf, slot, version, step and checksum.

Keys: `generate_key_pair` (`rlpipe weights keygen`) writes a PEM private key (mode 0600) and a
one-line public key, `ed25519:<base64>`, which a verifier takes inline or as a file. A key's
id is the first 16 hex digits of the SHA-256 of its public bytes. A verifier holds a list of
public keys, so a new key is trusted before the trainer's side switches to it (docs/weights.md,
"Signing weight versions").

Replays: a signed version stays signed, so a copy of an old announcement published again
verifies. `ReplayGuard` refuses an announcement whose version is below one read earlier in
the stream (stream order is announcement order: real versions never go down).
"""

from __future__ import annotations

import base64
import hashlib
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec
import structlog
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from prometheus_client import Counter

from libs.weights.errors import WeightsError
from proto.messages import PolicyIdentity, WeightAnnouncement, WeightManifest
from proto.same_host import SameHostVersion

log = structlog.get_logger(__name__)

DOMAIN = b"rlpipe.weights.signed/1\n"
PUBLIC_PREFIX = "ed25519:"
PRIVATE_FILE = "weights-signing.key"
PUBLIC_FILE = "weights-signing.pub"
# Announcements remembered for the replay check (a few snapshot periods' worth).
REPLAY_MEMORY = 4096

RefusalReason = Literal["unsigned", "forged", "replayed"]

REFUSED = Counter(
    "rlpipe_weights_signature_refused_total",
    "Weight versions refused by their signature (unsigned, forged or replayed)",
    ["reason", "path"],
)


class VersionRefused(WeightsError):
    """A version no receiver may apply: `reason` is unsigned, forged or replayed."""

    def __init__(self, reason: RefusalReason, message: str) -> None:
        super().__init__(message)
        self.reason: RefusalReason = reason


class VersionClaim(msgspec.Struct, array_like=True, frozen=True):
    """What a signature covers, encoded as a msgpack array in this field order."""

    what: Literal["announcement", "same_host"]
    key_id: str
    policy_digest: str
    version: int
    base_version: int | None
    base_hash: str | None
    kind: str
    target_hash: str
    chunk_hashes: list[str]
    manifest_sha256: str
    # same-host notices: shelf, slot, step and checksum
    place: str = ""


def announcement_claim(announcement: WeightAnnouncement) -> VersionClaim:
    """The claim an announcement's signature covers (its key id and policy as stated)."""
    manifest = announcement.manifest
    return VersionClaim(
        what="announcement",
        key_id=announcement.key_id,
        policy_digest=announcement.policy_digest,
        version=announcement.version,
        base_version=announcement.base_version,
        base_hash=manifest.base_hash,
        kind=announcement.kind,
        target_hash=announcement.version_hash,
        chunk_hashes=[chunk.payload_hash for chunk in manifest.chunks],
        manifest_sha256=manifest_sha256(manifest),
    )


def same_host_claim(notice: SameHostVersion) -> VersionClaim:
    """The claim a same-host notice's signature covers."""
    return VersionClaim(
        what="same_host",
        key_id=notice.key_id,
        policy_digest=notice.policy_digest,
        version=notice.version,
        base_version=None,
        base_hash=None,
        kind="same_host",
        target_hash="",
        chunk_hashes=[],
        manifest_sha256="",
        place=f"{notice.shelf_id}/{notice.slot}/{notice.step}/{notice.checksum}",
    )


def manifest_sha256(manifest: WeightManifest) -> str:
    """SHA-256 of the manifest's msgpack encoding (fields in declaration order), hex."""
    return hashlib.sha256(msgspec.msgpack.encode(manifest)).hexdigest()


def policy_digest(identity: PolicyIdentity | None) -> str:
    """A digest of what identifies the policy (not the tokenizer's configured name, which
    two processes may spell differently); "" for none."""
    if identity is None:
        return ""
    fields = [identity.tokenizer_hash, identity.tokenizer_vocab_size, identity.model_type,
              identity.model_vocab_size, identity.tensors_hash]  # fmt: skip
    return hashlib.sha256(msgspec.msgpack.encode(fields)).hexdigest()[:32]


def _signed_bytes(claim: VersionClaim) -> bytes:
    return DOMAIN + msgspec.msgpack.encode(claim)


def key_id(public: Ed25519PublicKey) -> str:
    """The id of a public key: 16 hex digits of the SHA-256 of its raw bytes."""
    return hashlib.sha256(_raw(public)).hexdigest()[:16]


def public_key_text(public: Ed25519PublicKey) -> str:
    """`ed25519:<base64>`: the one-line form a verifier takes inline or from a file."""
    return PUBLIC_PREFIX + base64.b64encode(_raw(public)).decode()


def _raw(public: Ed25519PublicKey) -> bytes:
    return public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def parse_public_key(source: str) -> Ed25519PublicKey:
    """A public key given inline (`ed25519:<base64>`) or as the path of a file holding one;
    ValueError naming what is wrong."""
    text = source.strip()
    if not text.startswith(PUBLIC_PREFIX):
        path = Path(text).expanduser()
        if not path.is_file():
            raise ValueError(
                f"signing public key {source!r} is neither `ed25519:<base64>` nor a file: "
                "give the .pub file `rlpipe weights keygen` wrote, or its one line"
            )
        text = path.read_text().strip()
        if not text.startswith(PUBLIC_PREFIX):
            raise ValueError(f"{path} does not hold an `ed25519:<base64>` public key")
    try:
        raw = base64.b64decode(text[len(PUBLIC_PREFIX) :], validate=True)
        return Ed25519PublicKey.from_public_bytes(raw)
    except ValueError as exc:
        raise ValueError(f"signing public key {source!r}: not 32 bytes of base64") from exc


class VersionSigner:
    """Signs announcements and same-host notices with one ed25519 private key."""

    def __init__(self, private_key: Ed25519PrivateKey) -> None:
        self._key = private_key
        self.public_key = private_key.public_key()
        self.key_id = key_id(self.public_key)

    @classmethod
    def load(cls, path: str | Path) -> VersionSigner:
        """The private key of `path` (PEM, as `rlpipe weights keygen` writes it)."""
        path = Path(path).expanduser()
        try:
            key = serialization.load_pem_private_key(path.read_bytes(), password=None)
        except (OSError, ValueError, TypeError) as exc:
            raise ValueError(
                f"cannot read the weights signing key {path}: {exc}. Make one with "
                "`rlpipe weights keygen --out DIR`"
            ) from exc
        if not isinstance(key, Ed25519PrivateKey):
            raise ValueError(f"{path} is not an ed25519 private key")
        if path.stat().st_mode & 0o007:  # (group: a Kubernetes Secret's fsGroup)
            log.warning("the weights signing key is readable by anyone: chmod 600", path=str(path))
        return cls(key)

    @classmethod
    def generate(cls) -> VersionSigner:
        return cls(Ed25519PrivateKey.generate())

    @property
    def public_text(self) -> str:
        return public_key_text(self.public_key)

    def verifier(self) -> VersionVerifier:
        """A verifier trusting this key only (the broadcaster reading its own chain back)."""
        return VersionVerifier({self.key_id: self.public_key})

    def sign_announcement(
        self, announcement: WeightAnnouncement, policy: str
    ) -> WeightAnnouncement:
        """`announcement` with this key's id, `policy` and the signature over its claim."""
        unsigned = msgspec.structs.replace(announcement, key_id=self.key_id, policy_digest=policy)
        signature = self._key.sign(_signed_bytes(announcement_claim(unsigned)))
        return msgspec.structs.replace(unsigned, signature=signature)

    def sign_same_host(self, notice: SameHostVersion, policy: str) -> SameHostVersion:
        """`notice` signed as `sign_announcement` signs an announcement."""
        unsigned = msgspec.structs.replace(notice, key_id=self.key_id, policy_digest=policy)
        signature = self._key.sign(_signed_bytes(same_host_claim(unsigned)))
        return msgspec.structs.replace(unsigned, signature=signature)


class VersionVerifier:
    """Checks signatures against the trusted public keys (several during a rotation).

    `allow_unsigned` takes unsigned versions too (signed ones are still verified): an
    explicit choice, logged, for a bus whose publishers are all trusted. With
    `expected_policy` set (the worker, once it checked the trainer's policy against its own),
    a version signed for another policy is refused as forged (one that states none, signed
    where the broadcaster could not read the trainer's identity, is not).
    """

    def __init__(
        self, keys: Mapping[str, Ed25519PublicKey], *, allow_unsigned: bool = False
    ) -> None:
        if not keys and not allow_unsigned:
            raise ValueError(
                "no public key to verify weight versions with: set the signers (the .pub file "
                "of `rlpipe weights keygen`, e.g. RLPIPE_ROLLOUT_WORKER_WEIGHTS_SIGNERS) or, "
                "where every publisher on the bus is trusted, allow_unsigned=true"
            )
        self._keys = dict(keys)
        self.allow_unsigned = allow_unsigned
        self.expected_policy: str | None = None

    @classmethod
    def from_config(cls, signers: Sequence[str], *, allow_unsigned: bool) -> VersionVerifier:
        """From public keys inline or in files (ValueError naming a bad one)."""
        keys = {key_id(k): k for k in map(parse_public_key, signers)}
        if allow_unsigned:
            log.warning(
                "weight versions are taken unsigned (allow_unsigned): anyone who can publish "
                "on the bus chooses the weights",
                trusted_keys=sorted(keys),
            )
        return cls(keys, allow_unsigned=allow_unsigned)

    @property
    def key_ids(self) -> list[str]:
        return sorted(self._keys)

    def check_announcement(self, announcement: WeightAnnouncement) -> bool:
        """True when signed by a trusted key; False when unsigned and allowed; VersionRefused
        otherwise."""
        return self._check(announcement, announcement_claim(announcement), "chain")

    def check_same_host(self, notice: SameHostVersion) -> bool:
        """As `check_announcement`, for a notice of the trainer's same-host shelf."""
        return self._check(notice, same_host_claim(notice), "same_host")

    def _check(
        self, signed: WeightAnnouncement | SameHostVersion, claim: VersionClaim, path: str
    ) -> bool:
        try:
            return self._verify(signed, claim)
        except VersionRefused as exc:
            REFUSED.labels(exc.reason, path).inc()
            raise

    def _verify(self, signed: WeightAnnouncement | SameHostVersion, claim: VersionClaim) -> bool:
        version = signed.version
        if not signed.signature:
            if self.allow_unsigned:
                return False
            raise VersionRefused("unsigned", f"version {version} is not signed")
        key = self._keys.get(signed.key_id)
        if key is None:
            if self.allow_unsigned and not self._keys:
                return False  # nothing to verify with: taken as unsigned
            raise VersionRefused(
                "forged",
                f"version {version} is signed by key {signed.key_id!r}, not one of the "
                f"trusted keys {self.key_ids}",
            )
        try:
            key.verify(signed.signature, _signed_bytes(claim))
        except InvalidSignature:
            raise VersionRefused(
                "forged", f"version {version}: the signature does not match what it announces"
            ) from None
        expected, stated = self.expected_policy, signed.policy_digest
        if expected is not None and stated and stated != expected:
            raise VersionRefused(
                "forged",
                f"version {version} is signed for policy {signed.policy_digest!r}, not the "
                f"trainer's {expected!r}",
            )
        return True


def chain_verifier(signer: VersionSigner | None) -> VersionVerifier:
    """How the signer's side reads its own chain back (a restart, a rebuild, a purge): its
    own key only; without a signer, unsigned."""
    return VersionVerifier({}, allow_unsigned=True) if signer is None else signer.verifier()


class ReplayGuard:
    """Refuses an announcement whose version is below one read before it in the stream.

    Real versions never go down in stream order (a snapshot point's delta and snapshot share
    a version); a signed announcement copied and published again sits after newer ones.
    Announcements read again (a receiver repositioned to an earlier snapshot) are judged by
    what came before them in the stream, so they pass as they did the first time.
    """

    def __init__(self) -> None:
        self._seen: dict[int, int] = {}  # stream sequence -> version

    def check(self, seq: int, version: int) -> None:
        """VersionRefused("replayed") for a replay; otherwise remember the announcement."""
        newest_before = max((v for s, v in self._seen.items() if s < seq), default=None)
        if newest_before is not None and version < newest_before:
            REFUSED.labels("replayed", "chain").inc()
            raise VersionRefused(
                "replayed",
                f"version {version} announced after version {newest_before}: a copy of an "
                "old version published again",
            )
        self._seen[seq] = version
        if len(self._seen) > REPLAY_MEMORY:
            del self._seen[min(self._seen)]


@dataclass(frozen=True)
class KeyPair:
    """The files `generate_key_pair` wrote."""

    private_path: Path
    public_path: Path
    key_id: str
    public_text: str


def generate_key_pair(
    out_dir: str | Path, *, public_dir: str | Path | None = None, overwrite: bool = False
) -> KeyPair:
    """Write a new ed25519 key pair: PRIVATE_FILE (PEM, mode 0600) into `out_dir` and
    PUBLIC_FILE (one line) into `public_dir` (default `out_dir`). FileExistsError if either
    exists, unless `overwrite`."""
    private_path = Path(out_dir).expanduser() / PRIVATE_FILE
    public_path = Path(public_dir or out_dir).expanduser() / PUBLIC_FILE
    if not overwrite:
        for path in (private_path, public_path):
            if path.exists():
                raise FileExistsError(f"{path} exists: a new key goes to a new folder")
    for path in (private_path, public_path):
        path.parent.mkdir(parents=True, exist_ok=True)
    signer = VersionSigner.generate()
    pem = signer._key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    private_path.unlink(missing_ok=True)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public_path.write_text(signer.public_text + "\n")
    return KeyPair(private_path, public_path, signer.key_id, signer.public_text)


def ensure_key_pair(out_dir: str | Path, *, public_dir: str | Path | None = None) -> KeyPair:
    """The key pair in `out_dir` (and `public_dir`), made if it is not there (a run's own
    pair; compose's first start)."""
    private_path = Path(out_dir) / PRIVATE_FILE
    public_path = Path(public_dir or out_dir) / PUBLIC_FILE
    if private_path.is_file() and public_path.is_file():
        signer = VersionSigner.load(private_path)
        if key_id(parse_public_key(str(public_path))) != signer.key_id:
            raise ValueError(f"{public_path} is not the public key of {private_path}")
        return KeyPair(private_path, public_path, signer.key_id, signer.public_text)
    return generate_key_pair(out_dir, public_dir=public_dir, overwrite=True)
