"""One `generate` call for the prompts of many concurrent tasks: the rollout-worker's batcher.

The engine is one model; decoding 8 tasks' groups together costs little more than one.
Each task handler awaits `batcher.generate(prompts, params)`; the batcher's `run` loop takes
every pending request that can share a call (same sampling rule, up to `max_batch_rows`
prompt rows in all), runs `engine.generate` in a worker thread so the event loop keeps serving the
bus, and resolves each request with its own completions:

    batcher = GenerationBatcher(engine, max_batch_rows=1024)
    asyncio.create_task(batcher.run())
    completions = await batcher.generate([prompt_ids] * 8, SamplingParams(max_tokens=4))

Requests share a call when they agree on everything but `max_tokens`: the call decodes up to
the largest, and each completion is cut back to its own request's `max_tokens`. That is
exact: a row's tokens never depend on how long it goes on afterwards.

An engine with continuous batching (`engine.continuous_batching`, the `paged` engine) merges
concurrent calls itself, at every decode step: then the batcher merges nothing and hands each
request to the engine the moment it arrives (`engine.submit`, whose future the engine's own
thread resolves: no thread waits per request), so an agent's next turn joins the running
batch at once instead of waiting for a whole call to end.

`gate` is held while calls run and `open` must be set for a call to start; the weights
follower takes the gate to swap weights between calls and clears `open` while the weights
are unusable. In continuous mode the gate is held across overlapping calls; once someone
waits for it (`gate.wanted`), no new call starts and the running ones finish first, so every
completion still comes from one version. `meter` measures the busy fraction (time inside
`generate` over wall time) and generated tokens per second.

Served requests (serve mode: `generate_served`, each a short hold of the engine,
libs.serve.holds) come second to rollouts: after a call with served rows, a waiting rollout
request goes next, and served calls take at most `served_share` of the engine's time
(`ServedShare`: a credit of engine seconds that grows at `served_share` a second; a served
call starts only while it is positive). So a rollout waits behind at most one served hold,
and a weight swap behind the call running now.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Literal

import structlog
from prometheus_client import Gauge, Histogram

from libs.engine.base import Completion, ContinuationScores, InferenceEngine, SamplingParams
from libs.rollout.throughput import ThroughputMeter
from proto.version_switches import cut_switches, end_version

log = structlog.get_logger(__name__)

# Prompt rows one engine call takes at most. The engine decodes them in chunks of its own
# max_batch_rows; a larger call only lets more requests start together (a GRPO group's
# single-turn episodes are one request each).
DEFAULT_MAX_BATCH_ROWS = 1024

BATCH_REQUESTS = Histogram(
    "rlpipe_rollout_batch_requests",
    "Requests (episode turns, task groups, API calls) decoded together in one generate call",
    buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512),
)
SERVED_IN_ENGINE = Gauge(
    "rlpipe_serve_engine_calls_running", "Served requests inside an engine call now"
)


class SwapGate(asyncio.Lock):
    """An asyncio.Lock that says when someone waits for it (`wanted`), so a continuous
    batcher stops starting calls and lets the running ones finish for a weight swap."""

    def __init__(self) -> None:
        super().__init__()
        self.wanted = asyncio.Event()
        self._num_waiting = 0

    async def acquire(self) -> Literal[True]:
        self._num_waiting += 1
        if self.locked():
            self.wanted.set()
        try:
            return await super().acquire()
        finally:
            self._num_waiting -= 1
            if self._num_waiting == 0:
                self.wanted.clear()


class ServedShare:
    """At most `share` of the engine's time for served calls: a credit of engine seconds
    that grows at `share` per second up to `burst_s`; a served call may start while it is
    positive and is charged its duration when it ends. `share` 1: no bound."""

    def __init__(self, share: float = 1.0, burst_s: float = 1.0) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"served share must be in (0, 1], got {share}")
        self.share = share
        self.burst_s = burst_s
        self._credit_s = burst_s
        self._at = time.monotonic()

    def wait_s(self) -> float:
        """Seconds until a served call may start (0: now)."""
        if self.share >= 1:
            return 0.0
        now = time.monotonic()
        self._credit_s = min(self.burst_s, self._credit_s + (now - self._at) * self.share)
        self._at = now
        return 0.0 if self._credit_s > 0 else -self._credit_s / self.share + 1e-3

    def charge(self, seconds: float) -> None:
        self.wait_s()  # bring the credit up to now first
        self._credit_s -= seconds


@dataclass
class _Request:
    prompts: list[list[int]]
    params: SamplingParams
    future: asyncio.Future[list[Completion]]
    served: bool = False

    @property
    def key(self) -> SamplingParams:
        """What requests must share to be decoded together (all but max_tokens)."""
        return dataclasses.replace(self.params, max_tokens=1)


class GenerationBatcher:
    """Merges concurrent generate requests into few engine calls, run off the event loop."""

    def __init__(
        self,
        engine: InferenceEngine,
        *,
        max_batch_rows: int = DEFAULT_MAX_BATCH_ROWS,
        batch_window_s: float = 0.005,
        meter: ThroughputMeter | None = None,
        served_share: float = 1.0,
    ) -> None:
        if max_batch_rows < 1:
            raise ValueError(f"max_batch_rows must be >= 1, got {max_batch_rows}")
        self.engine = engine
        self.max_batch_rows = max_batch_rows
        self.batch_window_s = batch_window_s
        self.meter = meter or ThroughputMeter()
        self.gate = SwapGate()
        self.open = asyncio.Event()
        self._pending: deque[_Request] = deque()
        self._arrived = asyncio.Event()
        self.share = ServedShare(served_share)
        self._last_served = False  # the last call decoded served rows: a rollout goes next
        self.num_calls = 0
        self.largest_batch = 0  # most requests decoded in one call so far
        self.num_served_in_engine = 0

    async def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        """One completion per prompt (a prompt listed G times gives a group of G), in order."""
        return await self._submit(prompts, params, served=False)

    async def generate_served(
        self, prompts: list[list[int]], params: SamplingParams
    ) -> list[Completion]:
        """As `generate`, for a served request's hold: after rollouts, within the share."""
        return await self._submit(prompts, params, served=True)

    async def _submit(
        self, prompts: list[list[int]], params: SamplingParams, *, served: bool
    ) -> list[Completion]:
        if not prompts:
            return []
        future: asyncio.Future[list[Completion]] = asyncio.get_running_loop().create_future()
        self._pending.append(_Request(prompts, params, future, served))
        self._arrived.set()
        return await future

    async def score(
        self, prompts: list[list[int]], continuations: list[list[int]]
    ) -> ContinuationScores:
        """`engine.score` run off the event loop under the gate, as a generate call is: it
        waits for `open`, and no weight swap starts while it runs (not batched with others).
        NotImplementedError when the engine cannot score."""
        await self._acquire_open_gate()
        try:
            call = asyncio.ensure_future(
                asyncio.to_thread(self.engine.score, prompts, continuations)
            )
            try:
                return await asyncio.shield(call)
            except asyncio.CancelledError:
                await asyncio.wait({call})  # the gate covers the whole engine call
                raise
        finally:
            self.gate.release()

    async def run(self) -> None:
        """Serve requests until cancelled."""
        if self.engine.continuous_batching:
            await self._run_continuous()
            return
        while True:
            await self._wait_for_requests()
            # Taken after the gate: requests that arrive during a weight swap join this call.
            await self._acquire_open_gate()
            try:
                batch = self._take_batch()
                if batch:
                    await self._run_batch(batch)
            finally:
                self.gate.release()

    async def _run_continuous(self) -> None:
        """Hand each request to the engine as it comes, under the gate (continuous mode)."""
        running: set[asyncio.Task[None]] = set()
        try:
            while True:
                await self._wait_for_takeable()
                await self._acquire_open_gate()
                try:
                    await self._hand_over(running)
                finally:
                    self.gate.release()
        finally:
            for task in running:
                task.cancel()

    async def _hand_over(self, running: set[asyncio.Task[None]]) -> None:
        """Start every request as it arrives until someone wants the gate or nothing runs;
        then wait for the running calls (the gate is held).

        The loop wakes on an arrival, on the gate being wanted, and when the last running
        call ends: O(1) a wake-up, where waiting on every running call as well would cost the
        event loop time per call in flight."""

        def ended(task: asyncio.Task[None]) -> None:
            running.discard(task)
            if not running:
                self._arrived.set()  # nothing runs: the loop gives the gate back

        while not self.gate.wanted.is_set():
            self._arrived.clear()
            for request in self._take_all():
                task = asyncio.create_task(self._run_alone(request))
                running.add(task)
                task.add_done_callback(ended)
            if not running:
                return
            # Served requests left pending (over the share) wake the loop when credit is back.
            served_wait = self.share.wait_s() if self._pending else None
            async with _deadline(served_wait):
                await _first_set(self._arrived, self.gate.wanted)
        if running:
            await asyncio.wait(set(running))

    def _take_all(self) -> list[_Request]:
        """Every pending request whose caller still waits (served ones within the share)."""
        self._drop_done()
        allow_served = self.share.wait_s() == 0
        taken = [r for r in self._pending if allow_served or not r.served]
        self._pending = deque(r for r in self._pending if not (allow_served or not r.served))
        return taken

    def _drop_done(self) -> None:
        """Forget requests whose callers stopped waiting (a cancelled task)."""
        if any(request.future.done() for request in self._pending):
            self._pending = deque(r for r in self._pending if not r.future.done())

    def _takeable_wait_s(self) -> float | None:
        """0 when a pending request may start now, None when none is pending, else the
        seconds until the share lets a pending served request start."""
        self._drop_done()
        if not self._pending:
            return None
        if any(not request.served for request in self._pending):
            return 0.0
        return self.share.wait_s()

    async def _wait_for_takeable(self) -> None:
        """Until a pending request may start."""
        while (wait_s := self._takeable_wait_s()) != 0:
            self._arrived.clear()
            async with _deadline(wait_s):
                await self._arrived.wait()

    async def _run_alone(self, request: _Request) -> None:
        """One engine call for one request (continuous mode), resolving its future."""
        start = time.monotonic()
        try:
            with self._engine_call([request]):
                call = self.engine.submit(request.prompts, request.params, 1)
                completions = await asyncio.wrap_future(call)
        except asyncio.CancelledError:
            request.future.cancel()
            raise
        except Exception as exc:
            _fail(request, exc)
            return
        self.num_calls += 1
        self.largest_batch = max(self.largest_batch, 1)
        self.meter.record(start, time.monotonic(), sum(len(c.token_ids) for c in completions))
        _resolve(request, completions)

    async def _wait_for_requests(self) -> None:
        """Until a request may start, then a short window for others to join it."""
        await self._wait_for_takeable()
        pending_rows = sum(len(request.prompts) for request in self._pending)
        if pending_rows < self.max_batch_rows and self.batch_window_s > 0:
            await asyncio.sleep(self.batch_window_s)

    def _take_batch(self) -> list[_Request]:
        """The oldest request that may start and the later ones that match it, while their
        rows fit in max_batch_rows (the first goes even if it alone is larger: the engine
        chunks it). Served requests may start within the share, not right after a served
        call while a rollout request waits, and go alone: a hold continues exactly the rows
        of the one before (the engine's continuation cache)."""
        self._drop_done()
        waiting_rollout = any(not request.served for request in self._pending)
        allow_served = self.share.wait_s() == 0 and not (self._last_served and waiting_rollout)
        eligible = [r for r in self._pending if allow_served or not r.served]
        if not eligible:
            return []
        batch = [eligible[0]]
        rows = len(eligible[0].prompts)
        for request in eligible[1:] if not eligible[0].served else ():
            fits = rows + len(request.prompts) <= self.max_batch_rows
            if fits and not request.served and request.key == batch[0].key:
                batch.append(request)
                rows += len(request.prompts)
        taken = {id(request) for request in batch}
        self._pending = deque(r for r in self._pending if id(r) not in taken)
        self._last_served = any(request.served for request in batch)
        return batch

    async def _run_batch(self, batch: list[_Request]) -> None:
        try:
            results = await self._generate(batch)
        except asyncio.CancelledError:
            for request in batch:
                request.future.cancel()
            raise
        except ValueError as exc:
            if len(batch) == 1:
                _fail(batch[0], exc)
                return
            # One request the engine refuses must not fail the others: run each alone.
            for request in batch:
                try:
                    _resolve(request, (await self._generate([request]))[0])
                except ValueError as alone:
                    _fail(request, alone)
            return
        except Exception as exc:
            for request in batch:
                _fail(request, exc)
            return
        for request, completions in zip(batch, results, strict=True):
            _resolve(request, completions)

    async def _acquire_open_gate(self) -> None:
        while True:
            await self.open.wait()
            await self.gate.acquire()
            if self.open.is_set():
                return
            self.gate.release()

    async def _generate(self, batch: list[_Request]) -> list[list[Completion]]:
        """Run one engine call for `batch` (the gate held); completions per request."""
        rows = [prompt for request in batch for prompt in request.prompts]
        params = dataclasses.replace(
            batch[0].params, max_tokens=max(r.params.max_tokens for r in batch)
        )
        start = time.monotonic()
        with self._engine_call(batch):
            completions = await asyncio.to_thread(self.engine.generate, rows, params, 1)
        end = time.monotonic()
        self.num_calls += 1
        self.largest_batch = max(self.largest_batch, len(batch))
        BATCH_REQUESTS.observe(len(batch))
        out: list[list[Completion]] = []
        at = 0
        for request in batch:
            mine = completions[at : at + len(request.prompts)]
            at += len(request.prompts)
            out.append([_truncated(c, request.params.max_tokens, i) for i, c in enumerate(mine)])
        self.meter.record(start, end, sum(len(c.token_ids) for group in out for c in group))
        return out

    @contextlib.contextmanager
    def _engine_call(self, batch: list[_Request]) -> Iterator[None]:
        """Around one engine call: count its served requests and charge their time."""
        served = sum(1 for request in batch if request.served)
        self.num_served_in_engine += served
        SERVED_IN_ENGINE.inc(served)
        start = time.monotonic()
        try:
            yield
        finally:
            self.num_served_in_engine -= served
            SERVED_IN_ENGINE.dec(served)
            if served:
                self.share.charge(time.monotonic() - start)


def _truncated(completion: Completion, max_tokens: int, index: int) -> Completion:
    """`completion` cut to `max_tokens` and renumbered as row `index` of its own request."""
    cut = len(completion.token_ids) > max_tokens
    routed = completion.routed_experts
    if cut and routed is not None:  # positions fed: the prompt's and all but the last token's
        routed = routed[: routed.shape[0] - len(completion.token_ids) + max_tokens]
    if cut and completion.version_switches:  # the versions of the tokens kept
        switches = cut_switches(completion.version_switches, max_tokens)
        end = end_version(switches)
        completion = dataclasses.replace(
            completion,
            version_switches=switches,
            policy_version_end=end,
            policy_version_end_hash=(
                completion.policy_version_end_hash if end == completion.policy_version_end else ""
            ),
        )
    return dataclasses.replace(
        completion,
        prompt_index=index,
        sample_index=0,
        token_ids=completion.token_ids[:max_tokens],
        logprobs=completion.logprobs[:max_tokens],
        raw_logprobs=completion.raw_logprobs[:max_tokens],
        finish_reason="length" if cut else completion.finish_reason,
        routed_experts=routed,
    )


def _resolve(request: _Request, completions: list[Completion]) -> None:
    if not request.future.done():
        request.future.set_result(completions)


def _fail(request: _Request, exc: BaseException) -> None:
    if not request.future.done():
        request.future.set_exception(exc)


def _deadline(seconds: float | None) -> contextlib.AbstractAsyncContextManager[object]:
    """Waits inside end quietly after `seconds` (None: never)."""
    if seconds is None:
        return contextlib.nullcontext()
    return _quiet_timeout(seconds)


@contextlib.asynccontextmanager
async def _quiet_timeout(seconds: float) -> AsyncIterator[None]:
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            yield


async def _first_set(*events: asyncio.Event) -> None:
    """Until one of `events` is set."""
    waiters = {asyncio.create_task(event.wait()) for event in events}
    try:
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for waiter in waiters:
            waiter.cancel()
