"""One step of the paged engine's running batch (libs/engine/paged.py runs them on its driver
thread): admit, then one forward that decodes a token for every running row and computes
short waiting prompts beside them as extra rows of the same graph, or a long prompt's chunk
eagerly and then the decode step; sample with per-row parameters and seeds; finished
sequences leave the batch.

    stepper = BatchStepper(runner, scheduler, tokenizer, admit_lock, None, use_cuda_graphs)
    stepper.step()              # under the engine's step lock, without grad
    stepper.num_steps, stepper.num_prefill_tokens, stepper.timings_s
"""

from __future__ import annotations

import threading
import time

import torch

from libs.engine.base import FinishReason
from libs.engine.model_runner import PagedModelRunner, PrefillChunk
from libs.engine.requests import hits_stop
from libs.engine.row_sampling import sample_rows, step_seeds
from libs.engine.sampling import SampledTokens
from libs.engine.scheduler import Scheduler, Sequence
from libs.tokenizer import Tokenizer

EAGER_PREFILL_ABOVE_GPU = 2048
EAGER_PREFILL_ABOVE_CPU = 128
"""Prompt tokens left from which a prompt is prefilled eagerly rather than staged in the
decode step (see `BatchStepper`), with CUDA graphs and without."""


class BatchStepper:
    """Runs the steps of one engine's batch and counts what they did."""

    def __init__(
        self,
        runner: PagedModelRunner,
        scheduler: Scheduler,
        tokenizer: Tokenizer,
        admit_lock: threading.Lock,
        eager_prefill_above: int | None,
        graphs: bool,
    ) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        # Prompts with fewer than `eager_prefill_above` tokens left are prefilled inside the
        # decode step, the runner's staged rows at most a step; longer ones eagerly. Staged
        # tokens attend through the decode kernel, one query row each: on a GPU that beats a
        # separate eager forward up to a few thousand tokens (docs/benchmarks.md); on CPU,
        # where each row gathers its whole context, only short prompts (agent turns) gain.
        if eager_prefill_above is None:
            eager_prefill_above = EAGER_PREFILL_ABOVE_GPU if graphs else EAGER_PREFILL_ABOVE_CPU
        self.eager_prefill_above = eager_prefill_above
        self._lock = admit_lock  # the engine's lock over the scheduler's queues
        self.num_steps = 0
        self.num_prefill_tokens = 0  # prompt tokens computed (not shared from the prefix cache)
        # Seconds per phase, summed over steps: the device work of a decode step and the wait
        # for its tokens, then the Python bookkeeping after it (GPU idle meanwhile), prefill.
        self.timings_s = {"decode_device": 0.0, "decode_host": 0.0, "prefill": 0.0}

    def step(self) -> None:
        """Admit, then one forward: short prompts staged beside the decoding rows (one graph
        replay), or a long prompt's chunk eagerly and then the decode step."""
        with self._lock:
            self.scheduler.admit()
        scheduler = self.scheduler
        left = [seq.prompt_len - seq.num_computed for seq in scheduler.prefilling]
        if left and max(left) >= self.eager_prefill_above:
            chunks = scheduler.plan_prefill() if scheduler.prefill_due() else []
            if chunks:
                start_s = time.perf_counter()
                self._prefill(chunks)
                self.timings_s["prefill"] += time.perf_counter() - start_s
            if scheduler.decoding:
                self._decode([])
        else:
            budget = self.runner.prefill_rows
            staged = scheduler.plan_prefill(budget) if scheduler.prefilling else []
            if staged or scheduler.decoding:
                self._decode(staged)
        self.num_steps += 1

    def _prefill(self, chunks: list[tuple[Sequence, PrefillChunk]]) -> None:
        """Run the chunks; sequences whose prompt is now computed sample their first token."""
        logits = self.runner.prefill([chunk for _, chunk in chunks])
        self.num_prefill_tokens += sum(len(chunk.token_ids) for _, chunk in chunks)
        finishing = []
        for row, (seq, chunk) in enumerate(chunks):
            self.scheduler.on_computed(seq, chunk.start + len(chunk.token_ids))
            if seq.num_computed == seq.prompt_len:
                finishing.append(row)
        if not finishing:
            return
        seqs = [chunks[row][0] for row in finishing]
        sampled = self._sample(logits[finishing], seqs, [0] * len(seqs))
        self._first_tokens(seqs, _host_rows(sampled))

    def _join_decoding(self, seqs: list[Sequence]) -> None:
        """Add sequences that sampled their first token to the running decode rows."""
        self.runner.rows.append(
            input_ids=[seq.token_ids[-1] for seq in seqs],
            positions=[len(seq.token_ids) - 1 for seq in seqs],
            tables=[seq.blocks for seq in seqs],
            temperatures=[seq.params.temperature for seq in seqs],
            top_ps=[seq.params.top_p for seq in seqs],
            seeds=[seq.seed for seq in seqs],
        )
        self.scheduler.decoding.extend(seqs)

    def _decode(self, staged: list[tuple[Sequence, PrefillChunk]]) -> None:
        """One token for every running row, and the `staged` prompt chunks computed in the
        same forward (their rows after the running ones); finished rows leave the batch and
        prompts that are now computed join it with their first token."""
        rows, decoding = self.runner.rows, self.scheduler.decoding
        n = rows.num_rows
        start_s = time.perf_counter()
        end, picked = self._stage(staged) if staged else (n, [])
        logits = self.runner.decode(end)
        if picked:  # the decoding rows, then the last row of each prompt that completes
            chosen = torch.tensor(list(range(n)) + [row for row, _ in picked])
            chosen = chosen.to(logits.device, non_blocking=True)
            logits = logits[chosen]
            temperatures, top_ps = rows.temperatures[chosen], rows.top_ps[chosen]
            seeds = step_seeds(rows.seeds[chosen], rows.num_generated[chosen])
        else:
            logits = logits[:n]
            temperatures, top_ps = rows.temperatures[:n], rows.top_ps[:n]
            seeds = step_seeds(rows.seeds[:n], rows.num_generated[:n])
        joining = [seq for _, seq in picked]
        all_top_p_one = all(seq.params.top_p >= 1.0 for seq in [*decoding, *joining])
        sampled = sample_rows(logits, temperatures, top_ps, seeds, all_top_p_one=all_top_p_one)
        if end > n:
            rows.unstage(end)
        if n:
            rows.advance(sampled.token_ids[:n])
        results = _host_rows(sampled)
        host_s = time.perf_counter()
        keep: list[int] = []
        finishing: list[tuple[Sequence, FinishReason]] = []
        running = zip(decoding, results[:n], strict=True)
        for index, (seq, (token, logprob, raw)) in enumerate(running):
            self.scheduler.on_computed(seq, seq.num_computed + 1)  # the input token's KV
            self.scheduler.record(seq, token, logprob, raw)
            if not self._stop_if_done(seq, finishing):
                keep.append(index)
        self._finish(finishing)
        if len(keep) < n:
            rows.keep(keep)
            self.scheduler.decoding = [decoding[index] for index in keep]
        if staged:
            self.num_prefill_tokens += sum(len(chunk.token_ids) for _, chunk in staged)
            for seq, chunk in staged:
                self.scheduler.on_computed(seq, chunk.start + len(chunk.token_ids))
            self._first_tokens(joining, results[n:])
        self.timings_s["decode_device"] += host_s - start_s
        self.timings_s["decode_host"] += time.perf_counter() - host_s

    def _stage(
        self, staged: list[tuple[Sequence, PrefillChunk]]
    ) -> tuple[int, list[tuple[int, Sequence]]]:
        """Stage the chunks' tokens as rows after the running ones; the rows in use, and
        (row, sequence) of each chunk that completes its prompt (its last token's row)."""
        rows = self.runner.rows
        ids: list[int] = []
        positions: list[int] = []
        table_of_row: list[int] = []
        picked: list[tuple[int, Sequence]] = []
        for index, (seq, chunk) in enumerate(staged):
            length = len(chunk.token_ids)
            ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start, chunk.start + length))
            table_of_row.extend([index] * length)
            if chunk.start + length == seq.prompt_len:
                picked.append((rows.num_rows + len(ids) - 1, seq))
        seqs = [seq for seq, _ in staged]
        sampling = (
            [seqs[i].params.temperature for i in table_of_row],
            [seqs[i].params.top_p for i in table_of_row],
            [seqs[i].seed for i in table_of_row],
        )
        tables = [seq.blocks for seq in seqs]
        return rows.stage(ids, positions, tables, table_of_row, sampling), picked

    def _first_tokens(self, seqs: list[Sequence], results: list[tuple[int, float, float]]) -> None:
        """Sequences whose prompt is computed take their first sampled token; those it does
        not finish join the decoding rows."""
        joined: list[Sequence] = []
        finishing: list[tuple[Sequence, FinishReason]] = []
        for seq, (token, logprob, raw) in zip(seqs, results, strict=True):
            self.scheduler.prefilling.remove(seq)
            self.scheduler.record(seq, token, logprob, raw)
            if not self._stop_if_done(seq, finishing):
                joined.append(seq)
        self._finish(finishing)
        if joined:
            self._join_decoding(joined)

    def _sample(
        self, logits: torch.Tensor, seqs: list[Sequence], counts: list[int]
    ) -> SampledTokens:
        """One token for each of `seqs` from `logits` [len(seqs), V] (prefill's first token)."""
        device = logits.device
        temperatures = torch.tensor([seq.params.temperature for seq in seqs], device=device)
        top_ps = torch.tensor([seq.params.top_p for seq in seqs], device=device)
        row_seeds = torch.tensor([seq.seed for seq in seqs], device=device)
        seeds = step_seeds(row_seeds, torch.tensor(counts, device=device))
        all_top_p_one = all(seq.params.top_p >= 1.0 for seq in seqs)
        return sample_rows(logits, temperatures, top_ps, seeds, all_top_p_one=all_top_p_one)

    def _stop_if_done(self, seq: Sequence, finishing: list[tuple[Sequence, FinishReason]]) -> bool:
        """True if `seq`'s newest token ends it, which adds it to `finishing`."""
        if hits_stop(seq.generated, seq.params, self.tokenizer):
            reason: FinishReason = "stop"
        elif len(seq.generated) >= seq.params.max_tokens:
            reason = "length"
        else:
            return False
        finishing.append((seq, reason))
        return True

    def _finish(self, finishing: list[tuple[Sequence, FinishReason]]) -> None:
        """Finish the sequences a step ended. A model that records routing first starts one
        copy of all their routing (their blocks still held: a later step's writes to them
        queue behind the copy)."""
        routing = self.runner.routing
        if routing is not None and finishing:
            reads = [(seq.blocks, seq.num_computed) for seq, _ in finishing]
            copies = routing.read(reads, self.runner.block_size)
            for (seq, _), copy in zip(finishing, copies, strict=True):
                seq.routing = copy
        for seq, reason in finishing:
            self.scheduler.finish(seq, reason)


def _host_rows(sampled: SampledTokens) -> list[tuple[int, float, float]]:
    """(token, logprob, raw logprob) per row, read from the device in one transfer."""
    stacked = torch.stack(
        [sampled.token_ids.double(), sampled.logprobs.double(), sampled.raw_logprobs.double()], 1
    )
    return [(int(token), logprob, raw) for token, logprob, raw in stacked.tolist()]
