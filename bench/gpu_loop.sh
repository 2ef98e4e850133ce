#!/usr/bin/env bash
# The learning loop on one GPU: trainer and rollout worker on CUDA with a random-init model
# of about 0.5B parameters (preset byte-0.5b: Qwen2.5-0.5B layers over the byte vocabulary,
# 492M parameters, bf16), everything else as in `make demo`.
#
#   [MODE=sync|async] [ENGINE=hf|paged] [MAX_STALENESS=N] [PUBLISH_EVERY=N] [EVAL_EVERY=N] \
#   [DECODE_PROCESS=true|false] [PROFILE_WORKER=S [PROFILE_AT=S]] [DIFF_DEVICE=cuda|] [ENCODE_THREADS=N] [HANDOVER=auto|state|delta] [HANDOVER_THREADS=N] [SNAPSHOT_EVERY=N] [LEARNING_RATE=X] [MAX_BATCH_TASKS=N] [QUEUE_DEPTH=N] [MAX_AHEAD=N] \
#       bash bench/gpu_loop.sh [SECONDS] [OUT_DIR]
#
# Trainer settings are the trainer's defaults unless given: for byte-0.5b that is fp32 master
# weights, a learning rate of 1e-5 and a staleness bound of 8 (chosen by model size,
# libs/trainer/config.py), a new version staged after every step in the background
# (libs/trainer/staging.py).
#
# Writes the loop's summary to bench/results/<card>/gpu_loop.json (or RESULT;
# bench/result_file.py), and the trainer's step records, the demo's summary, the tails of the
# service logs and the version latency by part (bench/version_latency.py) to OUT_DIR (default:
# a folder beside the run's, under /tmp; never the tree). Prints a table of step time,
# tokens/s, swap pause and train/inference mismatch. Needs the project importable
# (PYTHONPATH or an installed venv) and a CUDA device.
set -euo pipefail
seconds=${1:-240}
run=$(mktemp -d /tmp/rlpipe-gpu-loop-XXXX)
out=${2:-$run-bench}
mkdir -p "$out"
preset=${PRESET:-byte-0.5b} device=${DEVICE:-cuda}
export RLPIPE_TRAINER_POLICY_PRESET=$preset RLPIPE_ROLLOUT_WORKER_POLICY_PRESET=$preset
export RLPIPE_TRAINER_POLICY_DEVICE=$device RLPIPE_ROLLOUT_WORKER_POLICY_DEVICE=$device
[ -n "${PUBLISH_EVERY:-}" ] && export RLPIPE_TRAINER_PUBLISH_EVERY_STEPS=$PUBLISH_EVERY
[ -n "${MAX_STALENESS:-}" ] && export RLPIPE_TRAINER_MAX_STALENESS=$MAX_STALENESS
[ -n "${LEARNING_RATE:-}" ] && export RLPIPE_TRAINER_LEARNING_RATE=$LEARNING_RATE
# Tasks a worker rolls out at once: 16 here (256 rows of arith groups, a trainer batch per
# engine call) against the worker's default of 8. With the trainer's delta handover, one
# H200, 180 s each (2026-11-26, bench/results/h200/gpu_loop_handover_*): trainer busy 0.44
# (16), 0.38 (32) and 0.38-0.40 over three runs with 8; with 16 and the feeder two batches
# ahead (MAX_AHEAD=2 QUEUE_DEPTH=48) also 0.45, at 1.7% dropped and 2.4 s version latency.
export RLPIPE_ROLLOUT_WORKER_MAX_BATCH_TASKS=${MAX_BATCH_TASKS:-16}
# How far the feeder runs ahead of the trainer (env-gateway defaults: 32 tasks queued, one
# batch ahead): the tasks in flight over the pipeline's round trip bound samples/s.
[ -n "${QUEUE_DEPTH:-}" ] && export RLPIPE_ENV_GATEWAY_FEEDER_QUEUE_DEPTH_TASKS=$QUEUE_DEPTH
[ -n "${MAX_AHEAD:-}" ] && export RLPIPE_ENV_GATEWAY_FEEDER_MAX_AHEAD_VERSIONS=$MAX_AHEAD
# A 0.5B checkpoint (fp32 weights + AdamW state, ~6 GB) takes seconds the trainer waits for:
# the default every 4 steps made 11 of them in a 150 s run on an H200. One at the end.
export RLPIPE_TRAINER_CHECKPOINT_EVERY_STEPS=${CHECKPOINT_EVERY:-100000}
# The eval gate checkpoints every version it promotes (or scores best), and the trainer waits
# for that write: 5-7 s each, one every 10 versions by default, 63 of 152 s of a run on an
# H200 (2026-11-26, bench/results/h200/gpu_loop_ahead4: gaps after steps 31, 41, ...). Off
# here unless EVAL_EVERY is given, like the periodic checkpoints above.
export RLPIPE_TRAINER_EVAL_EVERY_VERSIONS=${EVAL_EVERY:-0}
# Deltas found on the card the trainer stages from (libs/weights/broadcaster.py DeviceBase);
# DIFF_DEVICE= (empty) for the host scan.
diff_device=${DIFF_DEVICE-$device}
[ -n "$diff_device" ] && export RLPIPE_WEIGHT_BROADCASTER_DIFF_DEVICE=$diff_device
# ENGINE=paged for the continuous-batching engine (with the trainer's delta handover: 53
# steps in 180 s, 42% dropped, the worker's announcements read 25 s late, decode 3.3 s:
# bench/results/h200/gpu_loop_handover_paged). On this task (2-token arith episodes, one
# request per sample) hf still trains more steps on an NVIDIA H200: 40 against 26 in 100 s,
# run back to back (2026-11-26, bench/results/h200/gpu_loop_100s_*), though paged now serves
# this request pattern faster by itself (1,255 against 823 episodes/s: bench/harness_bench.py,
# arith_loop). The loop is bound by weight-version latency (median 7.6 s paged, 4.3 s hf): in
# the rollout-worker a version's decode took 2.6 s beside the paged driver thread against
# 0.3 s beside hf (median), so more samples went stale (33% dropped against 20%). That
# decode makes synchronous copies on the default CUDA stream, which the paged engine kept
# busy; it now steps on a stream of its own (libs/engine/paged.py). Measured since (H200,
# 180 s, 2026-11-26, bench/results/h200/gpu_loop_paged_s6): 80 steps against 226 with hf,
# busy 0.12, version latency 14.6 s median, of it 7.2 s before the worker even read the
# announcement (notify) and 2.9 s of decode: the paged worker's event loop is starved.
# Found on 2026-11-27 (py-spy of the worker, bench/results/h200/worker_pyspy_paged): the
# batcher's throughput meter sorted the last minute's calls at every call, one per request
# here, so the event loop spent itself on it. With the meter O(1) (75 s run, H200,
# bench/results/h200/gpu_loop_paged_meter_fix, against gpu_loop_paged_batched before): decode
# 3.07 -> 0.78 s, notify 20.2 -> 3.8 s, version latency 25.2 -> 6.5 s, busy 0.17 -> 0.42,
# samples generated 154 -> 370/s; still 31% dropped as stale (hf: 0.4%), so hf stays the
# default here. On 2026-11-28 (H200, 180 s, zstd level 1 and 8 codec threads,
# bench/results/h200/gpu_loop_level1_paged against gpu_loop_level1_defaults for hf): paged 119
# steps, version latency 9.5 s median (notify 7.2 s: versions queued behind a decode of 0.92 s
# median, 0.24 s beside hf), 42% dropped, busy 0.30; hf 281 steps, 1.09 s, 0.2%, busy 0.43.
# Why the decode was slow beside paged (py-spy --gil of the worker, 120 s run, H200,
# bench/results/h200/gpu_loop_paged_profile): the event loop held the GIL 40% of the time,
# the decode threads 28%, the engine's driver 9%, and the chunks' decodes waited for it (4.8 s
# of wall time for 1.2 s of CPU, summed over threads, per version). The worker now decodes
# deltas in a process of its own (libs/weights/decode_process.py). 180 s each, H200,
# 2026-11-28 (bench/results/h200/gpu_loop_decode_*): paged 274 steps, latency 4.1 s median
# (decode 0.39 s, notify 2.6 s), 24% dropped, busy 0.47, reward above 0.8 after 95 s; hf 334
# steps, 1.76 s (decode 0.27 s), 12.6% dropped, busy 0.48, above 0.8 after 73 s; hf with
# DECODE_PROCESS=false in the same session 205 steps, 1.24 s (decode 0.31 s), none dropped,
# busy 0.41, above 0.8 after 73 s.
# The child then decoded against a host mirror instead of the GPU (same day, H200, 180 s):
# with the decoded writes sent back through its pipe (200 MB for an early 30 MB delta) it
# was worse (hf 96 steps, 12.9 s, 44% dropped: bench/results/h200/gpu_loop_mirror_pipe_*);
# through a shared staging buffer (bench/results/h200/gpu_loop_staging_*): hf 271 steps,
# busy 0.56, 5.4% dropped, 2.15 s median (1.0 s after version 200), above 0.8 after 90 s;
# LEARNING_RATE=1e-6 377 steps, busy 0.62, 0.8% dropped, 0.89 s; paged 279 steps, busy 0.45,
# 29% dropped, 3.95 s (notify 2.4 s: its versions still queue).
export RLPIPE_ROLLOUT_WORKER_ENGINE_TYPE=${ENGINE:-hf}
# DECODE_PROCESS=false: the worker decodes versions in its own threads instead of a child
# process (libs/weights/decode_process.py, the worker's default).
[ -n "${DECODE_PROCESS:-}" ] && export RLPIPE_ROLLOUT_WORKER_WEIGHTS_DECODE_PROCESS=$DECODE_PROCESS
export RLPIPE_ROLLOUT_WORKER_ENGINE_MAX_BATCH_ROWS=${MAX_BATCH_ROWS:-256}
if [ "${MODE:-async}" = sync ]; then
  # The synchronous baseline: every sample is generated by the version the trainer holds,
  # so the mismatch is measured on every token.
  export RLPIPE_TRAINER_MAX_STALENESS=0 RLPIPE_ENV_GATEWAY_FEEDER_MODE=sync
  export RLPIPE_TRAINER_PUBLISH_EVERY_STEPS=1
fi
export RLPIPE_ROLLOUT_WORKER_WEIGHTS_VERIFY_FULL=${VERIFY_FULL:-false}
# The trainer encodes each version after the first against the one before, on the card
# (weight_handover auto: its weights are on a GPU); HANDOVER=state stages each whole for
# the broadcaster to encode, as before. Its encode threads share the host with the rest.
[ -n "${HANDOVER:-}" ] && export RLPIPE_TRAINER_WEIGHT_HANDOVER=$HANDOVER
# 8 threads: a version's chunk encode on a 16-core H100 host took 0.91 s on 1 thread, 0.31 s
# on 4, 0.25 s on 8, 0.33 s on 12 and 0.36 s on 16 (bench/codec_threads.py, 2026-11-28,
# bench/results/h100/codec_threads.json); the worker's decode 0.56, 0.22, 0.26, 0.24, 0.28 s.
export RLPIPE_TRAINER_HANDOVER_THREADS=${HANDOVER_THREADS:-8}
export RLPIPE_WEIGHT_BROADCASTER_ENCODE_THREADS=${ENCODE_THREADS:-8}
# A snapshot (the whole 1 GB state, ~2 s to encode and store on an H200 host) every 10
# versions held the next version back; versions come every ~1.7 s here and no worker joins
# late, so one every 50 (a late joiner still catches up from it plus <= 50 deltas of ~15 MB).
export RLPIPE_WEIGHT_BROADCASTER_SNAPSHOT_EVERY_VERSIONS=${SNAPSHOT_EVERY:-50}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
python3 -c 'import torch; print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu")'
# PROFILE_WORKER=S: py-spy samples the rollout-worker for S seconds from PROFILE_AT seconds
# into the run (default 60), once with --gil (only the thread holding the GIL: who keeps the
# others waiting) and once over every thread; collapsed stacks to OUT_DIR/worker_*.txt.
if [ -n "${PROFILE_WORKER:-}" ]; then
  (
    sleep "${PROFILE_AT:-60}"
    pid=$(pgrep -f "services.rollout_worker" | head -n 1)
    py-spy record --gil --nonblocking -r 200 -d "$PROFILE_WORKER" -f raw -o "$out/worker_gil.txt" -p "$pid" > /dev/null 2>&1
    py-spy record --threads --nonblocking -r 100 -d "$PROFILE_WORKER" -f raw -o "$out/worker_threads.txt" -p "$pid" > /dev/null 2>&1
  ) &
fi
python3 -m apps.cli demo --duration-s "$seconds" --run-dir "$run" ${DEMO_ARGS:-} > "$out/summary.json" || true
cp "$run/trainer/steps.jsonl" "$out/steps.jsonl" || true
# Version latency (optimizer step end -> swapped in the worker), part by part.
python3 bench/version_latency.py "$run" --json "$out/version_latency.json" || true
if [ "${KEEP_LOGS:-1}" = 1 ]; then
  for s in trainer rollout-worker weight-broadcaster; do
    tail -n 40 "$run/logs/$s.log" > "$out/$s.log.txt" || true
  done
fi
result=${RESULT:-$(python3 -c 'import sys, torch; sys.path.insert(0, "bench")
from result_file import result_file
print(result_file("gpu_loop", torch.cuda.get_device_name() if torch.cuda.is_available() else None))')}
python3 - "$out" "$seconds" "$result" <<'PY'
import json, sys, pathlib
out, seconds, result = pathlib.Path(sys.argv[1]), float(sys.argv[2]), pathlib.Path(sys.argv[3])
rows = [json.loads(l) for l in (out / "steps.jsonl").read_text().splitlines() if l.strip()]
if not rows:
    sys.exit("no trainer steps recorded")
steady = rows[len(rows) // 4:] or rows
def mean(k, rs=steady): return sum(r.get(k, 0.0) for r in rs) / max(len(rs), 1)
same = [r for r in rows if r["mismatch_tokens"]]
trained = sum(r["num_samples"] for r in rows)
dropped = sum(r["num_dropped"] for r in rows)
start = rows[0]["time"] - rows[0]["step_s"] - rows[0]["wait_s"]
window = [sum(r["mean_reward"] for r in rows[i - 10:i]) / 10 for i in range(10, len(rows) + 1)]
best = max(window, default=0.0)
above = next((i + 10 for i, w in enumerate(window) if w > 0.8), None)
summary = {
    "steps": len(rows),
    "seconds": seconds,
    "stopped_because": f"the {seconds:.0f} s duration of the run ended",
    "samples_trained": trained,
    "samples_dropped_stale": dropped,
    "dropped_fraction": round(dropped / max(trained + dropped, 1), 4),
    "trainer_busy_fraction": round(rows[-1]["busy_fraction"], 3),
    "wait_for_weights_fraction_of_wait": round(
        sum(r.get("wait_weights_s", 0.0) for r in rows) / max(sum(r["wait_s"] for r in rows), 1e-9), 3),
    "step_s": round(mean("step_s"), 4),
    "trained_tokens_per_s": round(mean("tokens_per_s")),
    "samples_trained_per_s": round(trained / max(rows[-1]["time"] - start, 1e-9), 1),
    "samples_dropped_per_s": round(dropped / max(rows[-1]["time"] - start, 1e-9), 1),
    "reward_first10": round(sum(r["mean_reward"] for r in rows[:10]) / min(10, len(rows)), 4),
    "reward_last10": round(sum(r["mean_reward"] for r in rows[-10:]) / min(10, len(rows)), 4),
    "reward_best10": round(best, 4),
    "first_step_10_step_mean_above_0.8": above,
    "seconds_to_10_step_mean_above_0.8": round(rows[above - 1]["time"] - start, 1) if above else None,
    "reward_by_30s": [
        round(sum(r["mean_reward"] for r in b) / len(b), 3) if (b := [r for r in rows if t <= r["time"] - start < t + 30]) else None
        for t in range(0, int(seconds), 30)
    ],
    "mismatch_mean_abs": round(sum(r["mismatch_mean_abs"] for r in same) / len(same), 5) if same else None,
    "mismatch_tokens": sum(r["mismatch_tokens"] for r in same),
}
latency = out / "version_latency.json"
if latency.exists():
    summary["version_latency"] = json.loads(latency.read_text()).get("summary")
(out / "loop_summary.json").write_text(json.dumps(summary, indent=1))
result.write_text(json.dumps(summary, indent=1))
print(f"summary: {result}, run: {out}", file=sys.stderr)
print(json.dumps({k: v for k, v in summary.items() if k != "version_latency"}, indent=1))
PY
