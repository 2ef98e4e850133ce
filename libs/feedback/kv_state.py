"""A KV bucket's keys with compare-and-swap, a per-key TTL, scans and marker-free removal.

nats-py's `KeyValue.update` takes no TTL and its `delete`/`purge` leave a marker per key;
the feedback state needs both: every key it writes expires on its own (the join's bucket
holds about one join window), and a generation's waiting events go in one purge.

    keys = KvKeys(js, kv, streams.FEEDBACK_JOIN)   # kv: js.key_value("feedback_join")
    stored = await keys.read("gen.abc")          # value (None: absent) and revision
    revision = await keys.write("gen.abc", data, last=stored.revision, ttl_s=3600)
    async for key, value in keys.scan("wait.abc.>"): ...
    await keys.remove("wait.abc.>")              # every key under it, no markers left
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

from nats.js import JetStreamContext
from nats.js.errors import APIError, KeyNotFoundError, NotFoundError
from nats.js.kv import KeyValue

from libs.bus.stream_scan import scan_stream
from proto.streams import KeyValueSpec

EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
# JetStream's "wrong last sequence" error codes: the key changed since it was read.
WRONG_LAST_SEQUENCE = (10071, 10164)
KV_OPERATION = "KV-Operation"
# Keys a scan reads one by one before it sets up a consumer for the rest.
DIRECT_SCAN_KEYS = 16


@dataclass(frozen=True)
class Stored:
    """A key's current value (None: absent, deleted or expired) and its revision, which a
    compare-and-swap names (0: never written, or purged)."""

    value: bytes | None
    revision: int


class KvKeys:
    """The keys of the bucket `spec`, read through `kv` and written as plain JetStream
    publishes."""

    def __init__(self, js: JetStreamContext, kv: KeyValue, spec: KeyValueSpec) -> None:
        self._js = js
        self._kv = kv
        self._direct = spec.direct  # scans read by direct get where the bucket answers them
        self._prefix = f"$KV.{spec.bucket}."
        self._stream = f"KV_{spec.bucket}"

    async def read(self, key: str) -> Stored:
        try:
            entry = await self._kv.get(key)
        except KeyNotFoundError as exc:  # absent, or a delete/purge marker (its revision)
            marker = getattr(exc, "entry", None)
            return Stored(None, (marker.revision or 0) if marker is not None else 0)
        return Stored(entry.value or None, entry.revision or 0)

    async def write(self, key: str, value: bytes, *, last: int, ttl_s: float) -> int | None:
        """Store `value` if the key is still at revision `last` (0: must not exist): its new
        revision, or None when another writer changed it first. It expires `ttl_s` after
        this write (whole seconds, at least 1)."""
        headers = {EXPECTED_LAST_SUBJECT_SEQ: str(last)}
        ttl = max(1, math.ceil(ttl_s))
        try:
            ack = await self._js.publish(self._prefix + key, value, headers=headers, msg_ttl=ttl)
        except APIError as exc:
            if exc.err_code in WRONG_LAST_SEQUENCE:
                return None
            raise
        return ack.seq

    async def create(self, key: str, value: bytes, *, ttl_s: float) -> int | None:
        """Store `value` if the key holds none (absent, expired, or a delete marker left by
        an older writer): its revision, or None when the key holds a value."""
        revision = await self.write(key, value, last=0, ttl_s=ttl_s)
        if revision is not None:
            return revision
        stored = await self.read(key)
        if stored.value is None and stored.revision:
            return await self.write(key, value, last=stored.revision, ttl_s=ttl_s)
        return None

    async def remove(self, key_filter: str) -> None:
        """Remove every message of the keys `key_filter` matches (wildcards allowed): a purge
        of their subjects, which leaves no marker behind."""
        await self._js.purge_stream(self._stream, subject=self._prefix + key_filter)

    async def scan(self, key_filter: str) -> AsyncIterator[tuple[str, bytes]]:
        """The current value of every live key `key_filter` matches (a bucket of history 1:
        each key's one message). The first few come by direct gets, one request each (most
        filters match none or a few keys: a generation's waiting events); the rest through
        a consumer of their own, which costs more to set up and less per key."""
        subject = self._prefix + key_filter
        seq = 1
        for _ in range(DIRECT_SCAN_KEYS):
            try:
                raw = await self._js.get_msg(
                    self._stream, seq=seq, subject=subject, next=True, direct=self._direct
                )
            except NotFoundError:
                return
            if raw.data and raw.subject and not (raw.headers or {}).get(KV_OPERATION):
                yield raw.subject[len(self._prefix) :], raw.data
            seq = (raw.seq or seq) + 1
        async for msg in scan_stream(self._js, self._stream, subject, start_sequence=seq):
            if msg.data and not (msg.headers or {}).get(KV_OPERATION):
                yield msg.subject[len(self._prefix) :], msg.data
