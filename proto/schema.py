"""JSON Schema of the wire contract, for clients in other languages.

Run `python -m proto.schema` (or `make schema`) to write `proto/schema/`; `--check` exits
1 when the files there differ from what the code defines (a test runs it).
"""

from __future__ import annotations

import argparse
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import msgspec

from proto import streams
from proto.fleet import FleetCommand, FleetCommandReply, FleetDecision, ReplicaStatus
from proto.messages import (
    DeadLetter,
    EnvCloseReply,
    EnvCloseRequest,
    EnvResetReply,
    EnvResetRequest,
    EnvStepReply,
    EnvStepRequest,
    FeedbackEvent,
    Message,
    OnlineSample,
    PolicyIdentity,
    PromotionDecision,
    Rollout,
    ScoredRollout,
    ServedGeneration,
    Task,
    WeightAnnouncement,
    WeightsStaged,
)
from proto.rollout_contract import CONTRACT_VERSION, contract_schema
from proto.same_host import SameHostShelf, SameHostVersion

SCHEMA_DIR = Path(__file__).parent / "schema"

# Every message type on the wire.
ALL_MESSAGES: tuple[type[Message], ...] = (
    Task,
    Rollout,
    ScoredRollout,
    WeightAnnouncement,
    WeightsStaged,
    ServedGeneration,
    FeedbackEvent,
    OnlineSample,
    PromotionDecision,
    PolicyIdentity,
    DeadLetter,
    EnvResetRequest,
    EnvResetReply,
    EnvStepRequest,
    EnvStepReply,
    EnvCloseRequest,
    EnvCloseReply,
    SameHostShelf,
    SameHostVersion,
    FleetCommand,
    FleetCommandReply,
    ReplicaStatus,
    FleetDecision,
)


def message_schema(message_type: type[Message]) -> dict[str, object]:
    """The JSON Schema of one message type, with its schema id and wire encoding."""
    schema: dict[str, object] = _clean_descriptions(msgspec.json.schema(message_type))
    schema["$comment"] = (
        f"rlpipe message '{message_type.schema_id()}': msgpack on the wire, "
        "header Rlpipe-Schema carries the id"
    )
    return schema


def contract_document() -> dict[str, object]:
    """Streams, consumers and KV buckets, so other clients can find subjects."""
    return {
        "streams": [msgspec.to_builtins(s) for s in streams.ALL_STREAMS],
        "consumers": [msgspec.to_builtins(c) for c in streams.ALL_CONSUMERS],
        "kv": [msgspec.to_builtins(k) for k in streams.ALL_KV],
        "messages": {m.__name__: m.schema_id() for m in ALL_MESSAGES},
    }


def render_all() -> dict[str, str]:
    """File name -> file text for everything under proto/schema/."""
    files = {f"{m.SCHEMA}.v{m.SCHEMA_VERSION}.json": _dump(message_schema(m)) for m in ALL_MESSAGES}
    files["contract.json"] = _dump(contract_document())
    # Not a bus message: the rollout contract's objects in OpenAI-compatible HTTP bodies.
    files[f"rollout_contract.v{CONTRACT_VERSION}.json"] = _dump(contract_schema())
    return files


def stale_files(directory: Path = SCHEMA_DIR) -> list[str]:
    """Names of schema files that are missing, different, or no longer generated."""
    expected = render_all()
    present = {p.name for p in directory.glob("*.json")} if directory.exists() else set()
    stale = [
        name
        for name, text in expected.items()
        if name not in present or (directory / name).read_text() != text
    ]
    return sorted(stale + [name for name in present if name not in expected])


def write_all(directory: Path = SCHEMA_DIR) -> list[str]:
    """Write every schema file, remove ones no longer generated; return names written."""
    directory.mkdir(parents=True, exist_ok=True)
    expected = render_all()
    for path in directory.glob("*.json"):
        if path.name not in expected:
            path.unlink()
    for name, text in expected.items():
        (directory / name).write_text(text)
    return sorted(expected)


def _clean_descriptions(node: Any) -> Any:
    """`node` with every docstring-made "description" dedented (inspect.cleandoc): msgspec
    0.23 dedents them and 0.22 did not, so the files are the same under either."""
    if isinstance(node, dict):
        return {
            key: inspect.cleandoc(value)
            if key == "description" and isinstance(value, str)
            else _clean_descriptions(value)
            for key, value in node.items()
        }
    if isinstance(node, list):
        return [_clean_descriptions(item) for item in node]
    return node


def _dump(document: dict[str, object]) -> str:
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m proto.schema", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if proto/schema is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        if stale:
            print(f"stale JSON Schema files: {', '.join(stale)}; run `make schema`")
            return 1
        print("JSON Schema is up to date")
        return 0
    for name in write_all():
        print(f"wrote {SCHEMA_DIR / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
