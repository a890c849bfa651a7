#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go (each is skipped or absent without one): the gpu-marked tests
# (device payloads encoded, moved by nixl and cuda_ipc, decoded and rebuilt in device memory; a fan-out served
# on one GPU) and the transport benchmark. Logs under $1 (default runs/gpu).
#   bash tools/gpu_checks.sh [OUT_DIR]
set -o pipefail
OUT=${1:-runs/gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi -L 2>&1 | tee "$OUT/device.txt"
python3 -c "import torch, ray; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), 'ray', ray.__version__)" \
  2>&1 | tee -a "$OUT/device.txt"
timeout 240 python3 -m tools.bench_transport --sizes-mb 0.1,1,10,50 --repeats 10 --json "$OUT/transport.json" \
  2>&1 | tee "$OUT/transport.log"
timeout 420 python3 -m pytest -q -m gpu -rs tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
