"""Weight chunks on the bus: stored pipelined, fetched in parallel by direct get, verified.

Layout: chunk `i` of the delta (or snapshot) of version `v` is one message on subject
`rl.weights.chunks.<v>.<kind>.<i>` (proto.subjects.weight_chunk_subject) of the stream
RL_WEIGHT_CHUNKS (file storage, allow_direct); its body is the msgpack-encoded codec Chunk,
below the server's max payload (the encoder's max_chunk_bytes). Its Nats-Msg-Id names the
version, kind, index, target hash and payload hash: a retried publish is stored once, and a
re-encoding that came out different is stored anew and is what a fetcher reads (direct get
returns the last message of a subject).

    stored = await store_chunks(publisher, manifest, chunks)          # pipelined publish
    result = await fetch_chunks(nc, manifest, parallel=4)               # many gets in flight

`fetch_chunks` keeps up to `parallel` requests in flight, each a batch direct get
(`{"multi_last": [subjects], "batch": n}` on `$JS.API.DIRECT.GET.<stream>`, server >= 2.11,
answered by any replica or mirror) for a group of chunks, sized so that at most
`max_in_flight_bytes` of replies are pending, below the server's per-client limit (64 MiB by
default; a client past it is cut off as a slow consumer). `batch=False` asks for one chunk
per request (direct get, last by subject). Each chunk is decoded and checked against the
manifest (size, payload hash, version, index); a corrupt, missing or timed-out one is read
again alone, up to `attempts` reads in all, then the version is refused with
CorruptDeltaError. A replica that answers a direct get without the chunk (a follower not
yet caught up) is not the stream's last word: the chunk is then read from the stream's
leader (`$JS.API.STREAM.MSG.GET`), and only a chunk the leader lacks too (purged, never
stored) raises MissingChunkError. Nothing here writes to a model: a caller applies only a complete,
verified set.

Batches beat single gets, and a few requests in flight are enough because one asyncio
connection is CPU-bound reading (bench/weights_transport_bench.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import msgspec
import nats.errors
import structlog
from nats.aio.client import Client
from prometheus_client import Counter

from libs.bus import wire
from libs.bus.publisher import Publisher
from libs.weights.container import EncodedChunks
from libs.weights.errors import CorruptDeltaError, MissingChunkError
from libs.weights.format import Chunk, ChunkRef, Manifest, encode_chunk
from libs.weights.hashing import digest
from proto import streams
from proto.subjects import weight_chunk_subject

log = structlog.get_logger(__name__)

DEFAULT_PARALLEL = 4
DEFAULT_MAX_IN_FLIGHT_BYTES = 32 << 20  # half the server's default per-client pending limit
DEFAULT_ATTEMPTS = 3
MAX_BATCH = 64  # chunks asked for in one batch direct get
HEADER_ROOM_BYTES = 1024  # a chunk message's headers, below the server's max payload

CHUNK_REFETCHES = Counter(
    "rlpipe_weights_chunk_refetches_total",
    "Chunk reads repeated after a corrupt reply or a timeout",
    ["reason"],
)
CHUNK_LEADER_READS = Counter(
    "rlpipe_weights_chunk_leader_reads_total",
    "Chunks a replica's direct get did not hold yet, read from the stream's leader instead",
)
CHUNK_FETCHED_BYTES = Counter(
    "rlpipe_weights_chunk_fetched_bytes_total", "Bytes of weight chunks fetched and verified"
)


def manifest_kind(manifest: Manifest) -> str:
    """`snapshot` or `delta`: which chunk subjects hold this manifest's chunks."""
    return "snapshot" if manifest.is_snapshot else "delta"


def chunk_subject(manifest: Manifest, index: int) -> str:
    """Subject of chunk `index` of a manifest."""
    return weight_chunk_subject(manifest.version, manifest_kind(manifest), index)


def chunk_msg_id(manifest: Manifest, ref: ChunkRef) -> str:
    """Dedup id of a chunk: the same bytes are stored once, different bytes anew."""
    kind = manifest_kind(manifest)
    return f"w.{manifest.version}.{kind}.{ref.index}.{manifest.target_hash}.{ref.payload_hash}"


@dataclass(frozen=True)
class StoredChunks:
    """Where a manifest's chunks landed: stream sequences and bytes."""

    first_seq: int  # lowest stream sequence holding one of them (a dedup ack gives the original)
    last_seq: int
    num_bytes: int
    seconds: float


async def store_chunks(
    publisher: Publisher,
    manifest: Manifest,
    chunks: Sequence[Chunk],
    max_payload_bytes: int | None = None,
) -> StoredChunks:
    """Publish every chunk of a manifest, pipelined (the publisher bounds what is in flight)
    and retried with the same msg id; returns once the stream has stored all of them."""
    if len(chunks) != len(manifest.chunks):
        raise ValueError(f"{len(chunks)} chunks for a manifest listing {len(manifest.chunks)}")
    started = time.perf_counter()
    tasks = []
    num_bytes = 0
    # Chunks read from a delta file are their records already: published as they lie there.
    bodies = chunks.bodies if isinstance(chunks, EncodedChunks) else None
    for i, ref in enumerate(manifest.chunks):
        body = bodies[i] if bodies is not None else encode_chunk(chunks[i])
        if max_payload_bytes is not None and len(body) + HEADER_ROOM_BYTES > max_payload_bytes:
            raise ValueError(
                f"chunk {ref.index} is {len(body)} bytes, above the server's max payload "
                f"({max_payload_bytes}); encode with a smaller max_chunk_bytes"
            )
        num_bytes += len(body)
        headers = {wire.MSG_ID_HEADER: chunk_msg_id(manifest, ref)}
        subject = chunk_subject(manifest, ref.index)
        # cast: nats-py joins the body to its command bytes, which takes any buffer.
        publish = publisher.publish_raw(subject, cast(bytes, body), headers)
        tasks.append(asyncio.create_task(publish))
    try:
        acks = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    seqs = [ack.seq for ack in acks] or [0]
    return StoredChunks(min(seqs), max(seqs), num_bytes, time.perf_counter() - started)


@dataclass(frozen=True)
class FetchResult:
    """A manifest's chunks, complete and verified against it, in manifest order."""

    chunks: list[Chunk]
    num_bytes: int
    seconds: float
    num_refetched: int

    @property
    def mb_per_s(self) -> float:
        """Fetch throughput in MB/s (10^6 bytes)."""
        return self.num_bytes / max(self.seconds, 1e-9) / 1e6


async def fetch_chunks(
    nc: Client,
    manifest: Manifest,
    *,
    stream: str = streams.WEIGHT_CHUNKS.name,
    parallel: int = DEFAULT_PARALLEL,
    max_in_flight_bytes: int = DEFAULT_MAX_IN_FLIGHT_BYTES,
    attempts: int = DEFAULT_ATTEMPTS,
    timeout_s: float = 10.0,
    batch: bool = True,
    on_chunk: Callable[[Chunk], None] | None = None,
) -> FetchResult:
    """Fetch and verify every chunk of `manifest`; raises MissingChunkError or
    CorruptDeltaError (and fetches nothing more) when one cannot be had intact.

    `parallel` requests are in flight at a time; with `batch` each asks for a group of chunks
    at once (batch direct get, `multi_last`), else for one chunk (direct get by subject).
    `on_chunk(chunk)` is called on the event loop with each chunk as soon as it is verified
    (its payload hash matches the manifest), so its decode can start while the rest are
    fetched (libs/weights/pipelined.py).
    """
    if parallel < 1 or attempts < 1:
        raise ValueError("parallel and attempts must be >= 1")
    refs = list(manifest.chunks)
    largest = max((ref.num_bytes for ref in refs), default=1)
    workers = max(1, min(parallel, max_in_flight_bytes // max(largest, 1), len(refs)))
    group = max(1, min(MAX_BATCH, max_in_flight_bytes // (workers * largest))) if batch else 1
    fetcher = _Fetcher(nc, manifest, stream, attempts, timeout_s)
    results: dict[int, Chunk] = {}
    todo = iter([refs[i : i + group] for i in range(0, len(refs), group)])

    async def work() -> None:
        for refs_group in todo:  # one shared iterator: each group goes to one worker
            if len(refs_group) == 1:
                got = {refs_group[0].index: await fetcher.fetch(refs_group[0])}
            else:
                got = await fetcher.fetch_group(refs_group)
            results.update(got)
            if on_chunk is not None:
                for chunk in got.values():
                    on_chunk(chunk)

    started = time.perf_counter()
    tasks = [asyncio.create_task(work()) for _ in range(workers if refs else 0)]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    chunks = [results[ref.index] for ref in refs]
    num_bytes = sum(ref.num_bytes for ref in refs)
    CHUNK_FETCHED_BYTES.inc(num_bytes)
    return FetchResult(chunks, num_bytes, time.perf_counter() - started, fetcher.num_refetched)


class _Fetcher:
    """Reads chunks by direct get (one, or a group in one request) and checks them, with
    bounded refetches (one by one)."""

    def __init__(
        self, nc: Client, manifest: Manifest, stream: str, attempts: int, timeout_s: float
    ) -> None:
        self._nc = nc
        self._manifest = manifest
        self._stream = stream
        self._prefix = f"$JS.API.DIRECT.GET.{stream}."
        self._leader_get = f"$JS.API.STREAM.MSG.GET.{stream}"
        self._attempts = attempts
        self._timeout_s = timeout_s
        self.num_refetched = 0

    async def fetch_group(self, refs: list[ChunkRef]) -> dict[int, Chunk]:
        """Chunks of `refs` by one batch direct get; any not received intact is refetched."""
        subjects = {chunk_subject(self._manifest, ref.index): ref for ref in refs}
        bodies = await self._batch_get(list(subjects))
        out: dict[int, Chunk] = {}
        for subject, ref in subjects.items():
            body = bodies.get(subject)
            problem = "not in the batch reply"
            if body is not None:
                chunk, problem = await asyncio.to_thread(_checked, self._manifest, ref, body)
                if chunk is not None:
                    out[ref.index] = chunk
                    continue
            self._count_refetch(subject, 0, problem, "corrupt" if body is not None else "missing")
            out[ref.index] = await self.fetch(ref, attempts=max(1, self._attempts - 1))
        return out

    async def _batch_get(self, subjects: list[str]) -> dict[str, bytes]:
        """Last message of each subject, by one batch direct get (server >= 2.11); a subject
        the stream lacks, or a reply cut short by a timeout, is left out."""
        inbox = self._nc.new_inbox()
        replies: asyncio.Queue[Any] = asyncio.Queue()

        async def on_reply(msg: Any) -> None:
            replies.put_nowait(msg)

        sub = await self._nc.subscribe(inbox, cb=on_reply, pending_bytes_limit=0)
        bodies: dict[str, bytes] = {}
        try:
            request = json.dumps({"multi_last": subjects, "batch": len(subjects)}).encode()
            await self._nc.publish(f"$JS.API.DIRECT.GET.{self._stream}", request, reply=inbox)
            while True:
                msg = await asyncio.wait_for(replies.get(), self._timeout_s)
                headers = msg.headers or {}
                if headers.get("Status"):  # 204: end of batch; 404: none of them stored
                    break
                bodies[headers["Nats-Subject"]] = msg.data
                if len(bodies) == len(subjects):
                    break
        except TimeoutError:
            log.warning("batch direct get timed out", received=len(bodies), asked=len(subjects))
        finally:
            await sub.unsubscribe()
        return bodies

    async def fetch(self, ref: ChunkRef, attempts: int | None = None) -> Chunk:
        """One chunk by direct get (last message of its subject), up to `attempts` reads."""
        subject = chunk_subject(self._manifest, ref.index)
        attempts = self._attempts if attempts is None else attempts
        problem = "not fetched"
        for attempt in range(1, attempts + 1):
            try:
                reply = await self._nc.request(self._prefix + subject, b"", timeout=self._timeout_s)
                body = _reply_body(reply.data, reply.headers, subject)
                if body is None:
                    body = await self._stored_body(subject)
            except (nats.errors.TimeoutError, TimeoutError):  # fetch raises either
                problem, reason = f"no reply within {self._timeout_s} s", "timeout"
            else:
                # Hashing releases the GIL: on a thread it overlaps the reads of other chunks.
                chunk, problem = await asyncio.to_thread(_checked, self._manifest, ref, body)
                if chunk is not None:
                    return chunk
                reason = "corrupt"
            if attempt < attempts:
                self._count_refetch(subject, attempt, problem, reason)
        raise CorruptDeltaError(
            f"version {self._manifest.version}: chunk {ref.index} ({subject}) refused after "
            f"{self._attempts} attempts: {problem}"
        )

    async def _stored_body(self, subject: str) -> bytes:
        """The chunk as the stream's leader holds it, or MissingChunkError. A direct get is
        answered by any replica, and a follower that has not applied a just-stored chunk yet
        answers 404: on a 3-node cluster under load a worker refused a version for a chunk
        the stream had acknowledged, then waited for a snapshot that the starved trainer
        never made. The leader's message get is the stream's own answer."""
        request = json.dumps({"last_by_subj": subject}).encode()
        reply = await self._nc.request(self._leader_get, request, timeout=self._timeout_s)
        answer = json.loads(reply.data)
        error = answer.get("error")
        if error is not None and error.get("code") == 404:
            raise MissingChunkError(f"chunk {subject} is not stored (purged or never published)")
        if error is not None or "message" not in answer:
            raise CorruptDeltaError(f"message get of {subject} failed: {error or answer}")
        CHUNK_LEADER_READS.inc()
        return base64.b64decode(answer["message"].get("data") or "")

    def _count_refetch(self, subject: str, attempt: int, problem: str, reason: str) -> None:
        self.num_refetched += 1
        CHUNK_REFETCHES.labels(reason).inc()
        log.warning("refetching chunk", subject=subject, attempt=attempt, problem=problem)


def _reply_body(data: bytes, headers: dict[str, str] | None, subject: str) -> bytes | None:
    """The stored message body of a direct-get reply; None when the replica that answered
    does not hold it (404); an error naming any other status."""
    status = (headers or {}).get("Status")
    if not data and status:
        if status == "404":
            return None
        description = (headers or {}).get("Description", "")
        raise CorruptDeltaError(f"direct get of {subject} failed: {status} {description}")
    return data


def _checked(manifest: Manifest, ref: ChunkRef, body: bytes) -> tuple[Chunk | None, str]:
    """The chunk if it matches its manifest entry, else None and why not."""
    if len(body) != ref.num_bytes:
        return None, f"{len(body)} bytes, manifest says {ref.num_bytes}"
    try:
        chunk = msgspec.msgpack.decode(body, type=Chunk)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return None, f"does not decode: {exc}"
    header = chunk.header
    if (header.version, header.index, header.target_hash) != (
        manifest.version,
        ref.index,
        manifest.target_hash,
    ):
        return None, f"is chunk {header.index} of version {header.version}, not the one announced"
    if header.payload_hash != ref.payload_hash or digest(chunk.payload).hex() != ref.payload_hash:
        return None, "payload does not match its hash"
    return chunk, ""
