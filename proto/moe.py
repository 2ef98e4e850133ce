"""Mixture-of-experts routing as a rollout turn carries it (router replay): which experts
each token went to, compactly. Encoded and decoded by libs.moe.wire; checked by
proto.validation against the turn's tokens.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class RoutedExperts(msgspec.Struct, kw_only=True):
    """The experts an MoE policy routed tokens to, compactly: for each of the first
    `num_tokens` tokens of a turn (its position fed through the model), the `top_k` expert
    ids chosen by each of `num_layers` MoE layers. Later tokens of the turn have no record
    (the episode's last sampled token is never fed). Encoded by libs.moe.wire."""

    num_tokens: int
    num_layers: int
    top_k: int
    # Id dtype: uint8 for models of at most 256 experts, int16 beyond.
    dtype: Literal["uint8", "int16"]
    # The little-endian ids, [num_tokens, num_layers, top_k] in row-major order, the k of a
    # row in ascending order stored as the first id and the gaps after it (an expert set:
    # replay needs no ranking); as a zstd frame ("zstd") or as they are ("raw": a short
    # turn, where a frame's header costs more than it saves).
    data: bytes
    codec: Literal["zstd", "raw"] = "zstd"
