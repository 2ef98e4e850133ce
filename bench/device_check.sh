#!/usr/bin/env bash
# One call on a lent GPU machine: the CUDA tests and the GPU/CPU weight benchmarks.
#
#   bash bench/device_check.sh OUT_DIR
#
# Expects the wheels the image lacks in .whl/ (pure pip download for its Python; see the
# README's "GPU figures" section). Writes JSON results and logs to OUT_DIR.
set -uo pipefail
out=${1:?usage: device_check.sh OUT_DIR}
mkdir -p "$out"
python3 -m pip install --quiet --no-deps --target /tmp/site .whl/*.whl > "$out/pip.log" 2>&1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
nproc | tee -a "$out/gpu.txt"
python3 -m pytest -q -p no:cacheprovider tests/test_weights_gpu.py 2>&1 | tail -5 | tee "$out/cuda_tests.txt"
python3 bench/weights_gpu_bench.py --out "$out/weights_gpu.json" > "$out/weights_gpu.txt" 2>&1
tail -25 "$out/weights_gpu.txt"
python3 bench/weights_codec_bench.py --out "$out/weights_codec_host.json" > "$out/weights_codec.txt" 2>&1
tail -15 "$out/weights_codec.txt"
python3 bench/weights_transport_bench.py > "$out/weights_transport.txt" 2>&1
cp bench/results/weights_transport.json "$out/weights_transport_host.json"
tail -20 "$out/weights_transport.txt"
python3 bench/gpu_agentic_check.py --out "$out/gpu_agentic.json" > "$out/gpu_agentic.txt" 2>&1
tail -40 "$out/gpu_agentic.txt"
