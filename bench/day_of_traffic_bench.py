"""A day of product traffic on a serving fleet that lends itself to RL, against one that never
lends (issue #32 item 5).

    python bench/day_of_traffic_bench.py [--day-s 240] [--low-rps 0.3] [--high-rps 3.5]
                                         [--modes lending,never] [--rollout-workers 0]

Each mode starts a nats-server of its own and, in this process as tests/fleet_support.py
builds them: the trainer (its eval gate promotes version 0, which the replicas serve),
weight-broadcaster, env-gateway (arith, the async feeder), reward, `--rollout-workers`
rollout-workers of the RL cluster's own (none by default: on one machine they would only
take CPU from the replicas, and without them all RL is what lending adds), three lendable
serve replicas behind a load balancer that sends only to ready replicas
(libs/fleet/balancer.py: it probes /readyz every 0.1 s), and the capacity controller (one
replica serves 2 req/s, 50% headroom; `never`: max_lent 0, the fleet that never lends).
Once every replica serves, a diurnal trace is replayed as real HTTP:
rate(t) = low + (high - low) * sin^2(pi t / day_s), a night, a noon peak, a night again,
compressed into `--day-s` seconds.

Measured over the day, per mode: product requests, failed (anything but a 200 after the
balancer's retries), retried, latency p50/p99 (all, and the peak: the middle third); RL
samples trained per second and rollouts stored by who rolled them out; the loans: lend and
recall times, the episodes in flight at each recall and what became of them (finished within
the grace; requeued, then rolled out again or still queued at the end); the controller's
decisions with the load they were made on. The lending mode's RL samples/s over the never
mode's is the gain, its p99 over the never mode's the cost.

CPU figures: every service, the three replicas' engines and the load generator share the
machine's cores (2 on the VM), so lent replicas compete with serving ones for the same CPU,
unlike replicas on GPUs of their own. Result: bench/results/<machine>/day_of_traffic.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

from result_file import result_file, result_json

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from libs.bus.connection import connect_bus  # noqa: E402
from libs.fleet.config import ControllerConfig, LendingConfig  # noqa: E402
from libs.fleet.ledger import read_decisions  # noqa: E402
from libs.nats_server import NatsServer  # noqa: E402
from libs.trainer.metrics import read_step_samples  # noqa: E402
from proto.fleet import FleetDecision, RecallRecord  # noqa: E402
from tests.fleet_support import (  # noqa: E402
    Fleet,
    ProductLoad,
    queued_task_ids,
    scored_workers,
    serving_fleet,
)
from tests.signing_support import signing_environment  # noqa: E402

CONTROLLER = ControllerConfig(
    replica_capacity_rps=2.0,
    headroom=0.5,
    min_serving=1,
    lend_after_s=10.0,
    cooldown_s=5.0,
    recall_lead_s=10.0,
    trend_window_s=10.0,
)
# A load balancer probes every 0.1 s: a replica answers for a second after turning unready.
LENDING = LendingConfig(
    enabled=True, heartbeat_s=1.0, load_window_s=5.0, unready_grace_s=1.0, recall_grace_s=2.0
)
SAMPLE_S = 1.0
TIMELINE_COLUMNS = ["t_s", "rate_rps", "serving", "lent", "trained"]


def rate_at(t: float, day_s: float, low: float, high: float) -> float:
    return low + (high - low) * math.sin(math.pi * min(max(t, 0.0), day_s) / day_s) ** 2


async def run_mode(mode: str, args: argparse.Namespace) -> dict[str, Any]:
    controller = CONTROLLER if mode == "lending" else CONTROLLER.model_copy(update={"max_lent": 0})
    with tempfile.TemporaryDirectory(prefix=f"day-{mode}-") as tmp:
        server = NatsServer(store_dir=Path(tmp) / "nats")
        server.start()
        bus = await connect_bus(server.url, name="bench")
        try:
            run_dir = Path(tmp) / "run"
            fleet_run = serving_fleet(bus, run_dir, [LENDING] * 3, controller,
                                      rollout_workers=args.rollout_workers,
                                      batch_groups=args.batch_groups, feeder_ahead=2)  # fmt: skip
            async with fleet_run as fleet:
                return await replay_day(fleet, mode, args)
        finally:
            await bus.close()
            server.stop()


async def replay_day(fleet: Fleet, mode: str, args: argparse.Namespace) -> dict[str, Any]:
    await until(lambda: len(fleet.serving()) == 3, 300, "every replica serving version 0")
    load = ProductLoad(fleet.balancer, args.low_rps)
    trained_before = trained_ids(fleet)
    started = time.monotonic()
    sending = asyncio.create_task(load.run())
    timeline = []
    while (t := time.monotonic() - started) < args.day_s:
        load.rate_rps = rate_at(t, args.day_s, args.low_rps, args.high_rps)
        timeline.append([round(t, 1), round(load.rate_rps, 3), len(fleet.serving()),
                         len(fleet.lent()), len(trained_ids(fleet) - trained_before)])  # fmt: skip
        await asyncio.sleep(SAMPLE_S)
    sending.cancel()
    await load.drain()
    day_s = time.monotonic() - started
    trained = trained_ids(fleet) - trained_before
    by_worker = await scored_workers(fleet.bus)
    return {
        "mode": mode,
        "day_s": round(day_s, 1),
        "product": product_figures(load, started, args.day_s),
        "rl": {
            "samples_trained": len(trained),
            "samples_per_s": round(len(trained) / day_s, 3),
            "trained_by_worker": dict(Counter(by_worker.get(i, "?") for i in trained)),
            "trainer_steps": len(read_step_samples(fleet.run_dir)),
        },
        "loans": await loan_figures(fleet, by_worker),
        "decisions": [decision_figures(d) for d in await read_decisions(fleet.bus.js, 1000)],
        "timeline": {"columns": TIMELINE_COLUMNS, "rows": timeline},
    }


def decision_figures(decision: FleetDecision) -> dict[str, Any]:
    return {
        "action": decision.action,
        "replica": decision.replica_id,
        "load_rps": decision.load_requests_per_s,
        "forecast_rps": decision.forecast_requests_per_s,
        "accepted": decision.accepted,
        "reason": decision.reason,
    }


def product_figures(load: ProductLoad, started: float, day_s: float) -> dict[str, Any]:
    answered = [a for a in load.answers if a.status == 200]
    peak = [a for a, at in zip(load.answers, load.sent_at, strict=True)
            if a.status == 200 and day_s / 3 <= at - started < 2 * day_s / 3]  # fmt: skip
    return {
        "requests": len(load.answers),
        "failed": len(load.answers) - len(answered),
        "failed_by_status": dict(Counter(a.status for a in load.answers if a.status != 200)),
        "retried": load.balancer.num_retries,
        "latency_s": quantiles([a.latency_s for a in answered]),
        "peak_latency_s": quantiles([a.latency_s for a in peak]),
    }


async def loan_figures(fleet: Fleet, by_worker: dict[str, str]) -> dict[str, Any]:
    recalls: list[RecallRecord] = []
    lend_s: list[float] = []
    for replica in fleet.replicas:
        assert replica.lending is not None
        recalls += replica.lending.recalls
        lend_s += replica.lending.lend_seconds
    requeued = {t for r in recalls for t in r.requeued_task_ids}
    rolled_out = {i.rsplit(".", 1)[0] for i in by_worker}
    queued = await queued_task_ids(fleet.bus)
    return {
        "lends": len(lend_s),
        "recalls": len(recalls),
        "lend_s": quantiles(lend_s),
        "recall_s": quantiles([r.seconds for r in recalls]),
        "restored_bit_exact": sum(r.hash_matches for r in recalls),
        "tasks_in_flight_at_recall": sum(r.tasks_in_flight for r in recalls),
        "episodes_finished_in_grace": sum(r.episodes_finished for r in recalls),
        "episodes_requeued": sum(r.episodes_requeued for r in recalls),
        "requeued_tasks": len(requeued),
        "requeued_then_rolled_out": len(requeued & rolled_out),
        "requeued_still_queued": len((requeued - rolled_out) & queued),
        "requeued_lost": len(requeued - rolled_out - queued),
    }


def quantiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "max": None}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {"p50": round(statistics.median(ordered), 4), "p99": round(p99, 4),
            "max": round(ordered[-1], 4)}  # fmt: skip


def trained_ids(fleet: Fleet) -> set[str]:
    return {i for step in read_step_samples(fleet.run_dir) for i in step.sample_ids}


async def until(condition: Any, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {what} within {timeout_s:.0f} s")
        await asyncio.sleep(0.1)


def compare(results: dict[str, dict[str, Any]]) -> dict[str, Any]:
    lending, never = results.get("lending"), results.get("never")
    if lending is None or never is None:
        return {}
    base_p99 = never["product"]["latency_s"]["p99"]
    p99 = lending["product"]["latency_s"]["p99"]
    return {
        "rl_samples_per_s_gained": round(
            lending["rl"]["samples_per_s"] - never["rl"]["samples_per_s"], 3
        ),
        "rl_samples_ratio": _ratio(lending["rl"]["samples_per_s"], never["rl"]["samples_per_s"]),
        "p99_ratio": _ratio(p99, base_p99),
        "peak_p99_ratio": _ratio(
            lending["product"]["peak_latency_s"]["p99"], never["product"]["peak_latency_s"]["p99"]
        ),
        "failed_requests": lending["product"]["failed"],
    }


def _ratio(value: float | None, base: float | None) -> float | None:
    return round(value / base, 3) if value is not None and base else None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--day-s", type=float, default=240.0, help="the day, compressed")
    parser.add_argument("--low-rps", type=float, default=0.3, help="product requests/s at night")
    parser.add_argument("--high-rps", type=float, default=3.5, help="product requests/s at noon")
    parser.add_argument("--modes", default="lending,never", help="lending, never, or both")
    parser.add_argument(
        "--batch-groups", type=int, default=8, help="the trainer's GRPO groups a step"
    )
    parser.add_argument(
        "--rollout-workers", type=int, default=0, help="rollout-workers of the RL cluster's own"
    )
    args = parser.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    unknown = set(modes) - {"lending", "never"}
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}: use lending and/or never")
    for name, value in signing_environment().items():  # versions signed as deployed
        os.environ.setdefault(name, value)
    results = {mode: asyncio.run(run_mode(mode, args)) for mode in modes}
    document = {
        "benchmark": "day_of_traffic",
        "machine": {"cpus": platform.machine(), "cores": _cores(), "device": "cpu"},
        "commit": _commit(),
        "settings": {"day_s": args.day_s, "low_rps": args.low_rps, "high_rps": args.high_rps,
                     "batch_groups": args.batch_groups, "feeder_ahead_versions": 2,
                     "rollout_workers": args.rollout_workers,
                     "controller": CONTROLLER.model_dump(), "lending": LENDING.model_dump()},
        "modes": results,
        "comparison": compare(results),
    }  # fmt: skip
    path = result_file("day_of_traffic")
    path.write_text(result_json(document))
    print(json.dumps(document["comparison"], indent=2))
    print(f"wrote {path}")
    return 0


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _commit() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                          capture_output=True, text=True, check=False)  # fmt: skip
    return done.stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
