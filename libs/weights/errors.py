"""Exceptions of the weight codec, one per thing a receiver must react to differently."""

from __future__ import annotations


class WeightsError(Exception):
    """Base class of every error the weight codec raises on bad input."""


class BaseMismatchError(WeightsError):
    """The delta was encoded against a different version than the one the receiver holds."""


class CorruptDeltaError(WeightsError):
    """A manifest, chunk or delta file is truncated, altered or inconsistent."""


class MissingChunkError(CorruptDeltaError):
    """A chunk listed in the manifest was not supplied (or was supplied twice)."""
