"""The policy's identity on the bus: the trainer states what it trains, workers check it.

    identity = describe_policy(model.config, model.state_dict(), tokenizer, spec)
    await store_identity(js, identity)                      # the trainer, before any weights
    theirs = await wait_for_identity(js)                    # a worker, before any weights
    check_same_policy(ours, theirs)                         # ValueError naming the difference

A trainer and a worker configured with different tokenizers or vocabularies would otherwise
meet only later: a delta whose shapes do not fit, or token ids one side cannot decode.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import orjson
import structlog
import torch
import xxhash
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError
from transformers import PretrainedConfig

from libs.bus import wire
from libs.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from proto import streams
from proto.messages import PolicyIdentity

log = structlog.get_logger(__name__)

# How often a worker looks for the trainer's identity while none is stored yet.
IDENTITY_POLL_S = 0.5


def tokenizer_hash(tokenizer: Tokenizer) -> str:
    """XXH3-128 of the vocabulary (token -> id, specials included), hex."""
    if isinstance(tokenizer, ByteTokenizer):
        vocabulary = {**{f"<byte {i}>": i for i in range(256)}, **tokenizer.special_ids}
    elif isinstance(tokenizer, HFTokenizer):
        vocabulary = dict(tokenizer.hf.get_vocab())
    else:
        raise ValueError(f"cannot fingerprint tokenizer {type(tokenizer).__name__}")
    return xxhash.xxh3_128_hexdigest(orjson.dumps(sorted(vocabulary.items())))


def tensors_hash(tensors: Mapping[str, torch.Tensor]) -> str:
    """XXH3-128 of the tensor names and shapes (tied weights under every name), hex."""
    layout = sorted((name, list(tensor.shape)) for name, tensor in tensors.items())
    return xxhash.xxh3_128_hexdigest(orjson.dumps(layout))


def describe_policy(
    model_config: PretrainedConfig,
    tensors: Mapping[str, torch.Tensor] | None,
    tokenizer: Tokenizer,
    spec: str,
) -> PolicyIdentity:
    """The identity of a model (its transformers config and, when known, its tensors by
    name) paired with `tokenizer` (named `spec` in config)."""
    return PolicyIdentity(
        tokenizer=spec,
        tokenizer_hash=tokenizer_hash(tokenizer),
        tokenizer_vocab_size=tokenizer.vocab_size,
        model_type=str(model_config.model_type),
        model_vocab_size=int(model_config.vocab_size),
        tensors_hash="" if tensors is None else tensors_hash(tensors),
    )


def check_same_policy(ours: PolicyIdentity, trainers: PolicyIdentity) -> None:
    """ValueError naming every difference between this process's policy and the trainer's."""
    differences = []
    if ours.tokenizer_hash != trainers.tokenizer_hash:
        differences.append(
            f"tokenizer: ours is {ours.tokenizer!r} ({ours.tokenizer_vocab_size} ids), the "
            f"trainer's is {trainers.tokenizer!r} ({trainers.tokenizer_vocab_size} ids), and "
            "their vocabularies differ"
        )
    if (ours.model_type, ours.model_vocab_size) != (trainers.model_type, trainers.model_vocab_size):
        differences.append(
            f"model: ours is {ours.model_type} with a {ours.model_vocab_size}-token vocabulary, "
            f"the trainer's {trainers.model_type} with {trainers.model_vocab_size}"
        )
    elif ours.tensors_hash and trainers.tensors_hash and ours.tensors_hash != trainers.tensors_hash:
        differences.append("model: the parameter names or shapes differ from the trainer's")
    if differences:
        raise ValueError(
            "this policy is not the trainer's: "
            + "; ".join(differences)
            + ". Give both services the same policy (RLPIPE_<SERVICE>_POLICY_PATH, _PRESET, "
            "_TOKENIZER, _VOCAB_SIZE)"
        )


async def store_identity(js: JetStreamContext, identity: PolicyIdentity) -> None:
    """Write the trainer's identity to the state bucket."""
    kv = await js.key_value(streams.STATE.bucket)
    await kv.put(streams.POLICY_IDENTITY_KEY, wire.encode(identity))


async def load_identity(js: JetStreamContext) -> PolicyIdentity | None:
    """The identity the trainer stored, or None before any trainer has started."""
    kv = await js.key_value(streams.STATE.bucket)
    try:
        entry = await kv.get(streams.POLICY_IDENTITY_KEY)
    except KeyNotFoundError:
        return None
    return wire.decode(PolicyIdentity, entry.value or b"", None)


async def wait_for_identity(js: JetStreamContext) -> PolicyIdentity:
    """The trainer's identity, waiting for a trainer to store one."""
    waited = False
    while (identity := await load_identity(js)) is None:
        if not waited:
            log.info("waiting for the trainer to state its policy")
            waited = True
        await asyncio.sleep(IDENTITY_POLL_S)
    return identity
