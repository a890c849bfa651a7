#!/usr/bin/env bash
# The checks that need a CUDA GPU, in one go, logs under OUT_DIR (default runs/gpu):
#   1. `scd demo --config configs/gpu.yaml` (the main job on one GPU, codes over cuda_ipc), at a reduced
#      calibration budget: these are the mechanics and the timings, not the quality figures;
#   2. `scd serve` on the same config, `scd loadtest` against it, /healthz, then SIGTERM;
#   3. the gpu-marked tests (device payloads encoded, moved by nixl and cuda_ipc, decoded and rebuilt in device
#      memory; fan-outs served on one GPU);
#   4. `tools.bench_overhead` (the request path against Serve's floor) and the transport benchmark.
# Without CUDA it is a dry run of the same steps on CPU (object_store; the gpu tests skip).
#   bash tools/gpu_checks.sh [OUT_DIR]
set -o pipefail
OUT=$(realpath -m "${1:-runs/gpu}")
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
WORK=$(mktemp -d /tmp/scd-gpu-checks.XXXX)
CFG=$WORK/gpu.yaml
step() { echo "== $1 ($(date +%T))" | tee -a "$OUT/steps.log"; }

nvidia-smi -L 2>&1 | tee "$OUT/device.txt"
python3 - "$CFG" "$WORK" <<'EOF' 2>&1 | tee -a "$OUT/device.txt"
import sys, torch, ray, yaml
from pathlib import Path
cfg_path, work = sys.argv[1], Path(sys.argv[2])
cfg = yaml.safe_load(Path("configs/gpu.yaml").read_text())
for m in [cfg["producer"], *cfg["specialists"]]:
    m["path"] = str((Path("configs") / m["path"]).resolve())
    if not torch.cuda.is_available():
        m["num_gpus"] = 0
if not torch.cuda.is_available():
    cfg["transport"] = "object_store"
cfg["artifacts"]["uri"] = str(work / "store")
cfg["calibration"].update(prefixes=32, aligner_prefixes=32, val=3, heldout=4, aligner_epochs=10, pool=2,
                          finetune_samples=8, finetune_epochs=1, gate_vs_raw_kv=0, family_vs_pair=0,
                          recompute_blocks=False, work_dir=str(work / "calibrate"))
Path(cfg_path).write_text(yaml.safe_dump(cfg))
print("torch", torch.__version__, "cuda", torch.cuda.is_available(), "ray", ray.__version__,
      "transport", cfg["transport"])
EOF

step "scd demo"
timeout 300 python3 -m cli.main demo --config "$CFG" 2>&1 | tee "$OUT/demo.log"

step "scd serve + scd loadtest"
python3 -m cli.main serve --config "$CFG" > "$OUT/serve.log" 2>&1 &
SERVE=$!
for _ in $(seq 120); do grep -q "Serve ready on" "$OUT/serve.log" && break; kill -0 $SERVE 2>/dev/null || break; sleep 1; done
if grep -q "Serve ready on" "$OUT/serve.log"; then
  timeout 120 python3 -m cli.main loadtest --requests 200 --concurrency 8 --prefix-tokens 256 \
    > "$OUT/loadtest.json" 2> "$OUT/loadtest.err"
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/healthz').read().decode())" \
    > "$OUT/healthz.json"
fi
kill -TERM $SERVE 2>/dev/null; wait $SERVE; echo "scd serve exited $?" | tee -a "$OUT/steps.log"

step "gpu tests"
timeout 300 python3 -m pytest -q -m gpu -rs -p no:warnings tests/test_gpu.py 2>&1 | tee "$OUT/gpu_tests.log"
step "bench_overhead"
timeout 120 python3 -m tools.bench_overhead --config "$CFG" --n 100 2>&1 | tee "$OUT/overhead.log"

step "transports"
timeout 120 python3 -m tools.bench_transport --sizes-mb 0.1,1,10,50 --repeats 5 --json "$OUT/transport.json" \
  2>&1 | tee "$OUT/transport.log"
step "done"
rm -rf "$WORK"
