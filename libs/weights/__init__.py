"""Lossless, bit-exact weight deltas and snapshots (the delta codec) and their file format.

    manifest, chunks = encode(base, new, base_version=3, version=4)
    new_state = decode(base, manifest, chunks)          # or, in place:
    applier = DeltaApplier(state, manifest, current); applier.apply(chunk); applier.finish()

States are ordered mappings name -> numpy array, CPU torch tensor or RawTensor.
"""

from libs.weights.applier import DeltaApplier, decode
from libs.weights.container import pack_delta, read_delta_file, unpack_delta, write_delta_file
from libs.weights.encoder import EncodeOptions, EncodeTimes, encode, encode_snapshot
from libs.weights.errors import (
    BaseMismatchError,
    CorruptDeltaError,
    MissingChunkError,
    WeightsError,
)
from libs.weights.format import Chunk, ChunkHeader, Manifest, PieceHeader, TensorEntry, VersionInfo
from libs.weights.hashing import state_hash
from libs.weights.tensors import RawTensor, raw_state

__all__ = [
    "BaseMismatchError",
    "Chunk",
    "ChunkHeader",
    "CorruptDeltaError",
    "DeltaApplier",
    "EncodeOptions",
    "EncodeTimes",
    "Manifest",
    "MissingChunkError",
    "PieceHeader",
    "RawTensor",
    "TensorEntry",
    "VersionInfo",
    "WeightsError",
    "decode",
    "encode",
    "encode_snapshot",
    "pack_delta",
    "raw_state",
    "read_delta_file",
    "state_hash",
    "unpack_delta",
    "write_delta_file",
]
