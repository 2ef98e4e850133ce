"""`rlpipe weights`: diff, apply and verify safetensors files with the delta codec.

    rlpipe weights diff BASE.safetensors NEW.safetensors -o DELTA [--base-version N --version M]
    rlpipe weights snapshot NEW.safetensors -o DELTA [--version M]
    rlpipe weights apply BASE.safetensors DELTA -o OUT.safetensors   (BASE is '-' for a snapshot)
    rlpipe weights verify OUT.safetensors NEW.safetensors
    rlpipe weights relay-setup --hub-domain HUB [--nats-url URL] [--max-bytes N] [--max-age-s S]
    rlpipe weights relay-prune --signers KEY.pub [--nats-url URL] [--every-s S]   (relay.py)
    rlpipe weights keygen --out DIR [--public-out DIR] [--keep]   (signing weight versions)
    rlpipe weights key-id KEY              (the id of a .key or .pub file, as announcements name it)

Standalone: `python -m apps.weights_cli weights diff ...`.

Exit codes:
    0  success (verify: the files hold the same tensors, bit for bit)
    1  verify found a difference (the first ones are printed)
    2  usage or input error (missing or unreadable file, not safetensors, bad option)
    3  the delta's base is not the given BASE file
    4  the delta file is truncated or corrupted
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from libs.weights.applier import decode
from libs.weights.container import read_delta_file, write_delta_file
from libs.weights.encoder import EncodeOptions, encode, encode_snapshot
from libs.weights.errors import BaseMismatchError, CorruptDeltaError
from libs.weights.safetensors_io import read_safetensors, write_safetensors
from libs.weights.tensors import RawTensor

if TYPE_CHECKING:
    from libs.bus.connection import Bus

EXIT_OK, EXIT_MISMATCH, EXIT_USAGE, EXIT_WRONG_BASE, EXIT_CORRUPT = 0, 1, 2, 3, 4
MAX_REPORTED = 10


def add_weights_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register `weights` and its subcommands on an argparse subparsers object."""
    weights = subparsers.add_parser("weights", help="lossless weight deltas of safetensors files")
    commands = weights.add_subparsers(dest="weights_command", required=True)
    diff = commands.add_parser("diff", help="encode NEW as a delta against BASE")
    diff.add_argument("base", type=Path)
    diff.add_argument("new", type=Path)
    _add_encode_options(diff)
    diff.add_argument("--base-version", type=int, default=0)
    diff.set_defaults(handler=_on_diff)
    snapshot = commands.add_parser("snapshot", help="encode NEW whole (no base needed)")
    snapshot.add_argument("new", type=Path)
    _add_encode_options(snapshot)
    snapshot.set_defaults(handler=_on_snapshot)
    apply = commands.add_parser("apply", help="apply DELTA to BASE, writing OUT")
    apply.add_argument("base", help="base safetensors file, or '-' for a snapshot")
    apply.add_argument("delta", type=Path)
    apply.add_argument("-o", "--output", type=Path, required=True)
    apply.set_defaults(handler=_on_apply)
    verify = commands.add_parser("verify", help="check two files hold identical tensors")
    verify.add_argument("actual", type=Path)
    verify.add_argument("expected", type=Path)
    verify.set_defaults(handler=_on_verify)
    _add_relay_parsers(commands)
    _add_key_parsers(commands)


def _add_key_parsers(commands: argparse._SubParsersAction) -> None:
    """`keygen` and `key-id`: the key pair that signs weight versions (libs/weights/signing.py)."""
    keygen = commands.add_parser(
        "keygen", help="write a new ed25519 key pair that signs weight versions"
    )
    keygen.add_argument("--out", type=Path, required=True, help="folder (made if absent)")
    keygen.add_argument(
        "--public-out", type=Path, default=None, help="folder of the public key (default: --out)"
    )
    keygen.add_argument(
        "--keep", action="store_true", help="keep a pair already there (exit 0), else refuse"
    )
    keygen.set_defaults(handler=_on_keygen)
    key_id = commands.add_parser("key-id", help="print the id of a signing key (.key or .pub)")
    key_id.add_argument("key", type=Path)
    key_id.set_defaults(handler=_on_key_id)


def _on_keygen(args: argparse.Namespace) -> int:
    from libs.weights.signing import ensure_key_pair, generate_key_pair

    try:
        if args.keep:
            pair = ensure_key_pair(args.out, public_dir=args.public_out)
        else:
            pair = generate_key_pair(args.out, public_dir=args.public_out)
    except FileExistsError as exc:
        return _fail(f"{exc} (--keep keeps it)", EXIT_USAGE)
    print(f"private key {pair.private_path} (mode 600: the weight-broadcaster's and trainer's)")
    print(f"public key  {pair.public_path} (every rollout-worker, serve replica and relay)")
    print(f"key id      {pair.key_id}")
    print(pair.public_text)
    return EXIT_OK


def _on_key_id(args: argparse.Namespace) -> int:
    from libs.weights.signing import PUBLIC_PREFIX, VersionSigner, key_id, parse_public_key

    text = args.key.read_text()
    if text.strip().startswith(PUBLIC_PREFIX):
        print(key_id(parse_public_key(str(args.key))))
    else:
        print(VersionSigner.load(args.key).key_id)
    return EXIT_OK


def _add_relay_parsers(commands: argparse._SubParsersAction) -> None:
    """`relay-setup` and `relay-prune`: weights mirrored into a region (libs/weights/relay.py)."""
    default_url = os.environ.get("RLPIPE_NATS_URL", "nats://127.0.0.1:4222")
    setup = commands.add_parser(
        "relay-setup", help="mirror the hub's weight streams into this region's server"
    )
    setup.add_argument("--hub-domain", required=True, help="the hub server's JetStream domain")
    setup.add_argument("--nats-url", default=default_url, help="the REGIONAL server")
    setup.add_argument("--max-bytes", type=int, default=-1, help="cap per mirror (-1: none)")
    setup.add_argument("--max-age-s", type=float, default=0.0, help="age cap (0: none)")
    setup.set_defaults(handler=_on_relay_setup)
    prune = commands.add_parser(
        "relay-prune", help="drop regional copies of versions before the latest snapshot"
    )
    prune.add_argument("--nats-url", default=default_url, help="the REGIONAL server")
    prune.add_argument("--every-s", type=float, default=0.0, help="repeat every S s (0: once)")
    prune.add_argument(
        "--signers",
        default=os.environ.get("RLPIPE_WEIGHTS_SIGNERS", ""),
        help="public keys (.pub files or ed25519:... lines, comma-separated) a snapshot must "
        "be signed with to prune by it (default: $RLPIPE_WEIGHTS_SIGNERS)",
    )
    prune.add_argument(
        "--allow-unsigned", action="store_true", help="prune by unsigned snapshots too"
    )
    prune.set_defaults(handler=_on_relay_prune)


def _add_encode_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-o", "--output", type=Path, required=True)
    parser.add_argument("--version", type=int, default=None, help="target version (default base+1)")
    defaults = EncodeOptions()
    parser.add_argument("--max-chunk-bytes", type=int, default=defaults.max_chunk_bytes)
    parser.add_argument("--level", type=int, default=defaults.level, help="zstd level")
    parser.add_argument("--threads", type=int, default=defaults.threads)


def _options(args: argparse.Namespace) -> EncodeOptions:
    return EncodeOptions(
        max_chunk_bytes=args.max_chunk_bytes, level=args.level, threads=args.threads
    )


def _on_diff(args: argparse.Namespace) -> int:
    base, new = read_safetensors(args.base), read_safetensors(args.new)
    version = args.base_version + 1 if args.version is None else args.version
    manifest, chunks = encode(
        base, new, base_version=args.base_version, version=version, options=_options(args)
    )
    write_delta_file(args.output, manifest, chunks)
    changed = sum(e.num_changed for e in manifest.tensors)
    print(
        f"wrote {args.output}: version {version} against {args.base_version}, "
        f"{len(chunks)} chunks, "
        f"{changed} elements changed, {args.output.stat().st_size} bytes"
    )
    return EXIT_OK


def _on_snapshot(args: argparse.Namespace) -> int:
    new = read_safetensors(args.new)
    manifest, chunks = encode_snapshot(new, version=args.version or 0, options=_options(args))
    write_delta_file(args.output, manifest, chunks)
    print(f"wrote {args.output}: snapshot of version {manifest.version}, {len(chunks)} chunks")
    return EXIT_OK


def _on_apply(args: argparse.Namespace) -> int:
    manifest, chunks = read_delta_file(args.delta)
    if args.base == "-" and not manifest.is_snapshot:
        raise BaseMismatchError(
            f"{args.delta} is a delta against version {manifest.base_version}: give its BASE"
        )
    base = {} if args.base == "-" else read_safetensors(args.base)
    out = decode(base, manifest, chunks, kind="raw", verify_full=True)
    write_safetensors(args.output, out)
    print(f"wrote {args.output}: version {manifest.version} ({manifest.target_hash}), verified")
    return EXIT_OK


def _on_verify(args: argparse.Namespace) -> int:
    actual, expected = read_safetensors(args.actual), read_safetensors(args.expected)
    problems = differences(actual, expected)
    for line in problems[:MAX_REPORTED]:
        print(line)
    if problems:
        more = f" ({len(problems) - MAX_REPORTED} more)" if len(problems) > MAX_REPORTED else ""
        print(f"MISMATCH: {len(problems)} difference(s){more}")
        return EXIT_MISMATCH
    print(f"OK: {len(actual)} tensors identical")
    return EXIT_OK


def _on_relay_setup(args: argparse.Namespace) -> int:
    from libs.weights.relay import MirrorLimits, setup_relay

    limits = MirrorLimits(max_bytes=args.max_bytes, max_age_s=args.max_age_s)

    async def main() -> int:
        bus = await _connect(args.nats_url, "rlpipe-relay-setup")
        try:
            report = await setup_relay(bus.js, args.hub_domain, limits=limits)
        finally:
            await bus.close()
        for name, outcome in report.outcomes.items():
            print(f"{outcome:>9}  {name}")
        return EXIT_OK

    return _run_bus_command(main())


def _on_relay_prune(args: argparse.Namespace) -> int:
    from libs.weights.relay import mirror_status, prune_region
    from libs.weights.signing import VersionVerifier

    signers = [part.strip() for part in args.signers.split(",") if part.strip()]
    verifier = VersionVerifier.from_config(signers, allow_unsigned=args.allow_unsigned)

    async def main() -> int:
        bus = await _connect(args.nats_url, "rlpipe-relay-prune")
        try:
            while True:
                kept = await prune_region(bus.js, verifier)
                print(f"kept from snapshot {kept.snapshot_version}" if kept else "nothing to prune")
                print(f"mirrors: {await mirror_status(bus.js)}", flush=True)
                if args.every_s <= 0:
                    return EXIT_OK
                await asyncio.sleep(args.every_s)
        finally:
            await bus.close()

    return _run_bus_command(main())


async def _connect(url: str, name: str) -> Bus:
    from libs.bus.connection import connect_bus

    return await connect_bus(url, name=name, max_attempts=3)


def _run_bus_command(work: Coroutine[Any, Any, int]) -> int:
    """Run a command that talks to the bus; a bus or provisioning problem exits 2."""
    from libs.bus.connection import BusConnectError
    from libs.bus.provision import ProvisionError

    try:
        return asyncio.run(work)
    except (BusConnectError, ProvisionError) as exc:
        return _fail(str(exc), EXIT_USAGE)
    except KeyboardInterrupt:
        return EXIT_OK


def differences(actual: dict[str, RawTensor], expected: dict[str, RawTensor]) -> list[str]:
    """Human-readable differences in names, dtypes, shapes and bytes (order ignored)."""
    lines = [f"missing tensor {n!r}" for n in expected if n not in actual]
    lines += [f"unexpected tensor {n!r}" for n in actual if n not in expected]
    for name in (n for n in expected if n in actual):
        a, e = actual[name], expected[name]
        if (a.dtype, a.shape) != (e.dtype, e.shape):
            lines.append(f"{name}: {a.dtype}{list(a.shape)} != expected {e.dtype}{list(e.shape)}")
            continue
        bad = np.flatnonzero(a.units() != e.units())
        if bad.size:
            i = int(bad[0])
            got, want = int(a.units()[i]), int(e.units()[i])
            digits = 2 * e.width
            lines.append(
                f"{name}: {bad.size} of {e.numel} elements differ, first at flat index {i}: "
                f"0x{got:0{digits}x} != expected 0x{want:0{digits}x}"
            )
    return lines


def run(args: argparse.Namespace) -> int:
    """Run a parsed `weights` command, mapping errors to exit codes and one-line messages."""
    try:
        return int(args.handler(args))
    except BaseMismatchError as exc:
        return _fail(f"wrong base: {exc}", EXIT_WRONG_BASE)
    except CorruptDeltaError as exc:
        return _fail(f"corrupt delta: {exc}", EXIT_CORRUPT)
    except (OSError, ValueError) as exc:
        return _fail(str(exc), EXIT_USAGE)


def _fail(message: str, code: int) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point: `python -m apps.weights_cli weights ...`."""
    parser = argparse.ArgumentParser(prog="rlpipe")
    add_weights_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
