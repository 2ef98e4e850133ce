#!/usr/bin/env bash
# One call on a lent GPU machine: the CUDA tests and the GPU/CPU weight benchmarks.
#
#   bash bench/device_check.sh [LOG_DIR]
#
# Expects the wheels the image lacks in .whl/ (pure pip download for its Python; see
# docs/gpu.md). Each benchmark writes its JSON to bench/results/<card>/ (bench/result_file.py:
# the host's CPU figures under the card's name too); logs go to LOG_DIR (default: a temporary
# folder), never into the tree.
set -uo pipefail
out=${1:-$(mktemp -d /tmp/rlpipe-device-check-XXXX)}
mkdir -p "$out"
python3 -m pip install --quiet --no-deps --target /tmp/site .whl/*.whl > "$out/pip.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
BENCH_MACHINE=${BENCH_MACHINE:-$(python3 -c 'import sys, torch; sys.path.insert(0, "bench")
from result_file import machine; print(machine(torch.cuda.get_device_name()))')}
export BENCH_MACHINE
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
nproc | tee -a "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_weights_gpu.py 2>&1 | tail -5 | tee "$out/cuda_tests.txt"
python3 bench/weights_gpu_bench.py > "$out/weights_gpu.txt" 2>&1
tail -25 "$out/weights_gpu.txt"
python3 bench/weights_codec_bench.py > "$out/weights_codec.txt" 2>&1
tail -15 "$out/weights_codec.txt"
python3 bench/weights_transport_bench.py > "$out/weights_transport.txt" 2>&1
tail -20 "$out/weights_transport.txt"
python3 bench/gpu_agentic_check.py > "$out/gpu_agentic.txt" 2>&1
tail -40 "$out/gpu_agentic.txt"
echo "results: bench/results/$BENCH_MACHINE/, logs: $out"
