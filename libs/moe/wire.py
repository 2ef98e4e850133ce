"""MoE routing on the wire: ids as a zstd frame of little-endian small ints (proto's
RoutedExperts; the ids as they are when a frame would be larger), and back.

    routed = encode_routing(ids)          # ids [n, L, k] uint8/int16 -> RoutedExperts
    ids = decode_routing(routed)          # -> [n, L, k], each row's k ids in ascending order
    raw, wire = routing_bytes(routed)     # the size it would have raw, and has on the wire

Raw, a token costs L x k ids (uint8: tiny-moe 4 x 2 = 8 B, moe-1b 16 x 8 = 128 B). Replay
uses each layer's expert set, not the router's ranking within it, so the k ids of a row are
stored in ascending order as the first id and the gaps after it: small numbers zstd packs
well (uniformly random top-8 of 48 experts: 64 B a token of moe-1b instead of 91 for the ids
as chosen), on top of what repeats from token to token. Level 3, as the weight codec.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch
import zstandard

from proto.moe import RoutedExperts

ZSTD_LEVEL = 3
IdDtype = Literal["uint8", "int16"]
Codec = Literal["zstd", "raw"]
_DTYPES: dict[IdDtype, tuple[torch.dtype, np.dtype]] = {
    "uint8": (torch.uint8, np.dtype("<u1")),
    "int16": (torch.int16, np.dtype("<i2")),
}


def encode_routing(ids: torch.Tensor) -> RoutedExperts:
    """`ids` [n, L, k] (uint8 or int16, any device) as a compact wire record."""
    names: dict[torch.dtype, IdDtype] = {torch.uint8: "uint8", torch.int16: "int16"}
    name = names.get(ids.dtype)
    if name is None or ids.dim() != 3:
        raise ValueError(f"routing must be [n, L, k] uint8 or int16, got {ids.dtype} {ids.shape}")
    ascending = ids.detach().cpu().to(torch.int32).sort(dim=-1).values
    gaps = torch.cat([ascending[..., :1], ascending[..., 1:] - ascending[..., :-1]], dim=-1)
    array = gaps.to(ids.dtype).contiguous().numpy().astype(_DTYPES[name][1], copy=False)
    raw = array.tobytes()
    frame = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=False).compress(raw)
    codec: Codec = "zstd" if len(frame) < len(raw) else "raw"
    num_tokens, num_layers, top_k = ids.shape
    return RoutedExperts(
        num_tokens=num_tokens,
        num_layers=num_layers,
        top_k=top_k,
        dtype=name,
        data=frame if codec == "zstd" else raw,
        codec=codec,
    )


def decode_routing(routed: RoutedExperts) -> torch.Tensor:
    """The ids [num_tokens, num_layers, top_k] of a wire record; ValueError if it is corrupt."""
    torch_dtype, numpy_dtype = _DTYPES[routed.dtype]
    size = routed.num_tokens * routed.num_layers * routed.top_k * numpy_dtype.itemsize
    raw = routed.data
    if routed.codec == "zstd":
        try:
            raw = zstandard.ZstdDecompressor().decompress(raw, max_output_size=max(size, 1))
        except zstandard.ZstdError as exc:
            raise ValueError(f"routed_experts data is not a zstd frame: {exc}") from exc
    if len(raw) != size:
        raise ValueError(f"routed_experts holds {len(raw)} bytes, its shape needs {size}")
    array = np.frombuffer(raw, dtype=numpy_dtype).astype(numpy_dtype.newbyteorder("="))
    shape = (routed.num_tokens, routed.num_layers, routed.top_k)
    gaps = torch.from_numpy(array.reshape(shape)).to(torch.int32)
    return gaps.cumsum(dim=-1).to(torch_dtype)


def routing_bytes(routed: RoutedExperts) -> tuple[int, int]:
    """(raw bytes of the ids, bytes of their zstd frame on the wire)."""
    itemsize = _DTYPES[routed.dtype][1].itemsize
    return routed.num_tokens * routed.num_layers * routed.top_k * itemsize, len(routed.data)
