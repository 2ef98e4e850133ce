"""Router replay on a mixture of experts: the trainer's view of the engine's tokens, with
and without replaying the routing the engine recorded.

On one GPU: the moe-1b preset (Qwen3-MoE layers, 48 experts, top-8, 16 layers, random
init). The trainer holds fp32 master weights and computes in bf16 (libs.trainer.precision);
the paged engine runs its bf16 published copy and samples rollouts, recording the experts
every position was routed to. The trainer then scores the same tokens twice, as its step
does (libs.moe.routing under the trainer's autocast): with its own routing, and with the
recorded routing replayed (gate weights from its own router logits). Reported, on the
completion tokens:

- routing disagreement: token-layer pairs whose expert set differs between the engine and
  the trainer's own router (without replay: the routes the trainer would use; with replay
  the trainer uses the recorded ones, and its own router's choice on the replayed states is
  reported beside);
- mismatch: mean |trainer - engine| logprob and k3 KL(engine || trainer) (libs.rl.mismatch),
  and how many times lower each is with replay (issue #34's bar: at least 10x);
- routing bytes per token, raw and on the wire (libs.moe.wire: a zstd frame per turn).

    PYTHONPATH=. python3 bench/moe_replay_bench.py          # bench/results/<card>/moe_replay.json
    PYTHONPATH=. python3 bench/moe_replay_bench.py --policy-path RUN/trainer/checkpoints/step-N
    .venv/bin/python bench/moe_replay_bench.py --dry-run    # tiny-moe on CPU, small shapes

`--policy-path`: a trained MoE (a checkpoint of the moe-1b loop, `bench/gpu_loop.sh`) instead
of the random init, whose near-tied routers and interchangeable experts make flips cheap.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from result_file import git_commit, result_file, result_json

from libs.engine.base import Completion, SamplingParams
from libs.engine.paged import PagedEngine
from libs.moe.routing import NOT_RECORDED, moe_shape, replay_routing
from libs.moe.wire import encode_routing, routing_bytes
from libs.policy import PolicyConfig, build_policy, sequence_logprobs
from libs.rl.mismatch import mismatch_stats
from libs.tokenizer import ByteTokenizer
from libs.trainer.precision import TrainingPrecision

SCORE_ROWS = 16  # rows per trainer forward


def rollouts(
    engine: PagedEngine, prompts: int, samples: int, prompt_tokens: int, new_tokens: int
) -> tuple[list[list[int]], list[Completion]]:
    rng = random.Random(0)
    vocab = engine.tokenizer.vocab_size
    batch = [[rng.randrange(10, vocab - 10) for _ in range(prompt_tokens)] for _ in range(prompts)]
    params = SamplingParams(temperature=1.0, max_tokens=new_tokens, seed=0)
    return batch, engine.generate(batch, params, samples)


def trainer_batch(
    prompts: list[list[int]], completions: list[Completion], shape_lk: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """input_ids, attention_mask, completion mask [B, T-1], engine logprobs [B, T-1] and
    the recorded routing [B, T, L, k] (NOT_RECORDED on the last position and padding)."""
    rows = [prompts[c.prompt_index] + c.token_ids for c in completions]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    scored = torch.zeros(len(rows), width - 1, dtype=torch.bool)
    behavior = torch.zeros(len(rows), width - 1)
    routed = torch.full((len(rows), width, *shape_lk), NOT_RECORDED, dtype=torch.int16)
    for i, (row, c) in enumerate(zip(rows, completions, strict=True)):
        prompt_len = len(row) - len(c.token_ids)
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
        scored[i, prompt_len - 1 : len(row) - 1] = True
        behavior[i, prompt_len - 1 : len(row) - 1] = torch.tensor(c.raw_logprobs)
        assert c.routed_experts is not None, "the engine recorded no routing"
        routed[i, : c.routed_experts.shape[0]] = c.routed_experts.to(torch.int16)
    return {"ids": ids, "mask": mask, "scored": scored, "behavior": behavior, "routed": routed}


def score(
    model: Any, precision: TrainingPrecision, batch: dict[str, torch.Tensor], replay: bool
) -> tuple[torch.Tensor, float]:
    """The trainer's logprobs [B, T-1] and its own router's disagreement with the record."""
    device = next(model.parameters()).device
    out, differing, compared = [], 0, 0
    for start in range(0, batch["ids"].shape[0], SCORE_ROWS):
        rows = slice(start, start + SCORE_ROWS)
        ids, mask = batch["ids"][rows].to(device), batch["mask"][rows].to(device)
        recorded = batch["routed"][rows].to(device)
        with (
            torch.no_grad(),
            precision.compute(),
            replay_routing(model, recorded, replay=replay) as trace,
        ):
            out.append(sequence_logprobs(model, ids, mask).float().cpu())
        differing, compared = differing + int(trace.differing), compared + int(trace.compared)
    return torch.cat(out), differing / max(compared, 1)


def run(dry_run: bool, out: Path | None, policy_path: Path | None = None) -> dict[str, Any]:
    cuda = torch.cuda.is_available() and not dry_run
    policy = PolicyConfig(
        preset="moe-1b" if cuda else "tiny-moe",
        path=str(policy_path) if policy_path else None,
        device="cuda" if cuda else "cpu",
    )
    precision = TrainingPrecision.for_policy("fp32", policy)
    trainer_model = precision.build_model(policy)
    engine_model = build_policy(policy)
    engine_model.load_state_dict(precision.published_copy(trainer_model))
    shape = moe_shape(engine_model)
    assert shape is not None
    prompts, samples, prompt_tokens, new_tokens = (32, 8, 64, 192) if cuda else (4, 4, 16, 24)
    engine = PagedEngine(engine_model, ByteTokenizer(), prompts * samples)
    prompt_ids, completions = rollouts(engine, prompts, samples, prompt_tokens, new_tokens)
    batch = trainer_batch(prompt_ids, completions, (shape.num_layers, shape.top_k))
    figures: dict[str, Any] = {}
    for name, replay in (("without_replay", False), ("with_replay", True)):
        logprobs, own_disagreement = score(trainer_model, precision, batch, replay)
        stats = mismatch_stats(logprobs, batch["behavior"], batch["scored"])
        figures[name] = {
            "routing_disagreement": 0.0 if replay else round(own_disagreement, 5),
            "own_router_disagreement": round(own_disagreement, 5),
            **{k: round(v, 6) if isinstance(v, float) else v for k, v in asdict(stats).items()},
        }
    raw = wire = tokens = 0
    for c in completions:
        assert c.routed_experts is not None
        r, w = routing_bytes(encode_routing(c.routed_experts))
        raw, wire, tokens = raw + r, wire + w, tokens + int(c.routed_experts.shape[0])
    without, with_ = figures["without_replay"], figures["with_replay"]
    card = torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.machine()})"
    report: dict[str, Any] = {
        "benchmark": "moe_replay",
        "command": "python bench/moe_replay_bench.py" + (" --dry-run" if dry_run else ""),
        "git_commit": git_commit(),
        "card": card,
        "policy": policy.path or f"preset {policy.preset} (random init)",
        "trainer": "fp32 masters, bf16 autocast" if precision.mixed else "fp32",
        "engine": f"paged, {next(engine_model.parameters()).dtype}",
        "rollouts": {
            "prompts": prompts,
            "samples": samples,
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "completion_tokens": int(batch["scored"].sum()),
        },
        **figures,
        "kl_lower_with_replay_x": round(without["kl"] / max(with_["kl"], 1e-12), 1),
        "mean_abs_diff_lower_with_replay_x": round(
            without["mean_abs_diff"] / max(with_["mean_abs_diff"], 1e-12), 1
        ),
        "routing_bytes_per_token": {"raw": round(raw / tokens, 2), "wire": round(wire / tokens, 2)},
    }
    target = out or result_file("moe_replay", card if cuda else None)
    target.write_text(result_json(report))
    print(json.dumps(report, indent=2))
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="tiny-moe on CPU, small shapes")
    parser.add_argument("--out", type=Path, default=None, help="where to write the JSON")
    parser.add_argument(
        "--policy-path", type=Path, default=None, help="a trained MoE's folder (a checkpoint)"
    )
    args = parser.parse_args()
    if not args.dry_run and not torch.cuda.is_available():
        sys.exit("moe_replay_bench measures a GPU: run it on one, or pass --dry-run")
    run(args.dry_run, args.out, args.policy_path)


if __name__ == "__main__":
    main()
