"""How long each policy version took from the trainer's optimizer step to the worker's swap.

Reads a run folder of `rlpipe demo` (or bench/gpu_loop.sh): the trainer's step records and
the JSON log lines of the trainer, the weight-broadcaster and the rollout-worker, joined by
version. Per version, in order:

    hold      optimizer step end -> the trainer's stager starts on it (the previous
              version still being staged; libs/trainer/staging.py)
    stage     the copy to the host, the safetensors file written and announced to the
              broadcaster (a delta the trainer encodes: the delta file written and announced)
    queue     staged -> the broadcaster starts on it (the previous version still encoding)
    diff      find the elements that changed against the base (a delta the trainer encodes
              on its GPU: the device diff, and the changes' copy to the host mirror)
    encode    the rest of the encode: load the staged file, hash the target, encode the
              chunks (a delta the trainer encodes: its encode and the file's write there,
              and the broadcaster's read of the file)
    store     chunks onto the bus, announcement published
    notify    announced -> the worker starts fetching
    fetch     chunks fetched and verified
    decode    chunks decoded against the worker's weights (generation goes on)
    gate_wait the engine calls running when decoding ended finish (the swap waits for them)
    apply     the swap pause: decoded values written into the live weights
    total     optimizer step end -> swapped in the worker

and two figures inside `decode`: decode_chunk_wall and decode_chunk_cpu, the wall and the
CPU time of the chunks' decodes summed over chunks (the worker decodes on several threads;
wall well above CPU says the decode threads waited, for the GIL or a lock).

Versions a worker took from the trainer's memory on the same host (docs/weights.md, "On the
trainer's host") skip the chain's parts; they are summed up apart, under `same_host`:

    share     optimizer step end -> the version written into the trainer's shelf and announced
    notify    announced -> the worker starts on it
    gate_wait the engine calls running then finish
    apply     the swap pause: the slot copied into the live weights (and its checksum)
    total     optimizer step end -> swapped in the worker

    .venv/bin/python bench/version_latency.py RUN_DIR [--json OUT]

Prints the median, p90 and max of each part over the versions found in every log, and the
median total of the versions made in each 30 s of the run (early versions of a run are the
big deltas: Adam's first steps change more elements), and writes them (with the per-version
rows) as JSON when --json is given.
"""

from __future__ import annotations

import argparse
import json
import statistics
from datetime import datetime
from pathlib import Path
from typing import Any

PARTS = (
    "hold",
    "stage",
    "queue",
    "diff",
    "encode",
    "store",
    "notify",
    "fetch",
    "decode",
    "gate_wait",
    "apply",
    "total",
    "decode_chunk_wall",
    "decode_chunk_cpu",
)


def log_events(path: Path, event: str) -> dict[int, dict[str, Any]]:
    """The last `event` line per version of a JSON log (other lines are skipped)."""
    found: dict[int, dict[str, Any]] = {}
    if not path.exists():
        return found
    for line in path.read_text(errors="replace").splitlines():
        if not line.startswith("{"):
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("event") == event and isinstance(record.get("version"), int):
            if event == "weight version announced" and record.get("kind") != "delta":
                continue  # a snapshot of the same version follows its delta; workers take deltas
            found[record["version"]] = record
    return found


def timestamp(record: dict[str, Any]) -> float:
    """Unix time of a structlog line's ISO timestamp."""
    return datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()


def step_ends(run_dir: Path) -> dict[int, float]:
    """Unix time at which the step that made each version ended (its record's time)."""
    path = run_dir / "trainer" / "steps.jsonl"
    if not path.exists():
        return {}
    ends: dict[int, float] = {}
    for line in path.read_text().splitlines():
        record = json.loads(line)
        ends[int(record["version"])] = float(record["time"])
    return ends


SAME_HOST_PARTS = ("share", "notify", "gate_wait", "apply", "total")


def same_host_rows(run_dir: Path) -> list[dict[str, float]]:
    """One row per version the worker took from the trainer's memory."""
    ends = step_ends(run_dir)
    swapped = log_events(run_dir / "logs" / "rollout-worker.log", "weights swapped")
    rows = []
    for version in sorted(set(ends) & set(swapped)):
        line = swapped[version]
        if line.get("kind") != "same_host":
            continue
        total = timestamp(line) - ends[version]
        taken = float(line["since_published_s"])  # announced -> swapped
        gate_wait, apply = float(line.get("gate_wait_s", 0.0)), float(line["pause_s"])
        rows.append({
            "version": version, "step_end": ends[version], "share": total - taken,
            "notify": taken - gate_wait - apply, "gate_wait": gate_wait, "apply": apply,
            "total": total,
        })  # fmt: skip
    return rows


def version_rows(run_dir: Path) -> list[dict[str, float]]:
    """One row of part durations (seconds) per version seen at every stage."""
    logs = run_dir / "logs"
    ends = step_ends(run_dir)
    staged = log_events(logs / "trainer.log", "weights staged")
    announced = log_events(logs / "weight-broadcaster.log", "weight version announced")
    fetched = log_events(logs / "rollout-worker.log", "weight version fetched")
    swapped = log_events(logs / "rollout-worker.log", "weights swapped")
    rows = []
    for version in sorted(set(ends) & set(staged) & set(announced) & set(fetched) & set(swapped)):
        lines = (staged[version], announced[version], fetched[version], swapped[version])
        rows.append({**row(version, ends[version], *lines), "step_end": ends[version]})
    return rows


def row(
    version: int,
    step_end: float,
    staged: dict[str, Any],
    announced: dict[str, Any],
    fetched: dict[str, Any],
    swapped: dict[str, Any],
) -> dict[str, float]:
    """The parts of one version's latency, from its log lines."""
    encode_s, store_s = float(announced["encode_s"]), float(announced["store_s"])
    fetch_s = float(fetched["mb"]) / max(float(fetched["mb_per_s"]), 1e-9)
    decode_s = float(swapped.get("decode_s", 0.0))
    gate_wait_s = float(swapped.get("gate_wait_s", 0.0))
    t_staged, t_announced = timestamp(staged), timestamp(announced)
    t_fetched, t_swapped = timestamp(fetched), timestamp(swapped)
    hold_s = float(staged.get("waited_s", 0.0))
    trainer_encode_s = float(staged.get("encode_s", 0.0))  # a delta encoded by the trainer
    diff_s = float(staged.get("diff_s", 0.0)) + float(announced.get("diff_s", 0.0))
    return {
        "version": version,
        "hold": hold_s,
        "stage": t_staged - step_end - hold_s - trainer_encode_s,
        "queue": t_announced - t_staged - encode_s - store_s,
        "diff": diff_s,
        "encode": trainer_encode_s + encode_s - diff_s,
        "store": store_s,
        "notify": t_fetched - fetch_s - t_announced,
        "fetch": fetch_s,
        "decode": decode_s,
        "gate_wait": gate_wait_s,
        "apply": float(swapped["pause_s"]),
        "total": t_swapped - step_end,
        "decode_chunk_wall": float(swapped.get("decode_chunk_wall_s", 0.0)),
        "decode_chunk_cpu": float(swapped.get("decode_chunk_cpu_s", 0.0)),
    }


def summarize(rows: list[dict[str, float]], parts: tuple[str, ...] = PARTS) -> dict[str, Any]:
    """Median, p90 and max of every part, in seconds."""
    if not rows:
        return {"versions": 0}
    summary: dict[str, Any] = {"versions": len(rows)}
    for part in parts:
        values = sorted(r[part] for r in rows)
        p90 = values[min(len(values) - 1, int(0.9 * len(values)))]
        summary[part] = {
            "median_s": round(statistics.median(values), 4),
            "p90_s": round(p90, 4),
            "max_s": round(values[-1], 4),
        }
    summary["total_median_by_30s"] = total_by_window(rows, WINDOW_S)
    return summary


WINDOW_S = 30.0


def total_by_window(rows: list[dict[str, float]], window_s: float) -> list[float | None]:
    """Median total latency of the versions whose step ended in each `window_s` of the run
    (from the first such step; None for a window without one)."""
    first = min(r["step_end"] for r in rows)
    windows: dict[int, list[float]] = {}
    for r in rows:
        windows.setdefault(int((r["step_end"] - first) // window_s), []).append(r["total"])
    return [
        round(statistics.median(windows[i]), 3) if i in windows else None
        for i in range(max(windows) + 1)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--json", type=Path, help="write the summary and rows here")
    args = parser.parse_args()
    rows, local = version_rows(args.run_dir), same_host_rows(args.run_dir)
    summary, same_host = summarize(rows), summarize(local, SAME_HOST_PARTS)
    print_summary("version latency over the delta chain", summary, PARTS)
    print_summary("version latency from the trainer's memory", same_host, SAME_HOST_PARTS)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        document = {
            "summary": summary,
            "same_host": same_host,
            "rows": rows,
            "same_host_rows": local,
        }
        args.json.write_text(json.dumps(document, indent=2) + "\n")


def print_summary(title: str, summary: dict[str, Any], parts: tuple[str, ...]) -> None:
    print(f"{title}: {summary['versions']} versions (seconds: median / p90 / max)")
    for part in parts if summary["versions"] else ():
        figures = summary[part]
        median, p90, most = figures["median_s"], figures["p90_s"], figures["max_s"]
        print(f"  {part:<10} {median:>8.3f} {p90:>8.3f} {most:>8.3f}")
    if summary["versions"]:
        print(f"  total, median by {WINDOW_S:.0f} s of the run: {summary['total_median_by_30s']}")


if __name__ == "__main__":
    main()
