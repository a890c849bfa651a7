#!/usr/bin/env bash
# Figures at size on one GPU, from timing families (docs/timing-families.md: Llama 3's 1B and 8B shapes,
# random weights built on the device, nothing to carry): tables under OUT_DIR (default runs/gpu-size).
#   0. where pytest is installed: the static decode caches' CUDA graphs against the eager steps (tests);
#   1. tools.bench_size at the 1B, then the 8B shape: every plan kind against the own prefill at 4k, 16k and
#      32k tokens (time to first token cold and cached, modeled links, fan-outs of 4 and 8);
#      then decode tokens/s at batch 1, 8 and 32 (the engines' step and the static-cache CUDA-graph step);
#      at 16k tokens every phase once more under torch.profiler (profile.md: the device's busy share, the top
#      kernels and host operators; a Chrome trace per phase); then tools.bench_transport: the payload's
#      delivery between processes (cuda_ipc; nixl where it is installed) at the 8B codes' sizes;
#   2. the 8B timing family served: jobs.timing_family, `scd serve`, `scd loadtest --compare` at 8
#      concurrent with 4k-token prefixes, /healthz, then SIGTERM;
#   3. tools.bench_overhead on the 1B timing family: the request path against Serve's floor; then, when the run
#      is under 7.5 minutes, the same with payloads of up to 1 MiB in their tickets (the 1B codes of the
#      bench's 110-token prefix, ~0.36 MB, then skip the pull from the producer).
# Without CUDA it rehearses the same steps on CPU at the tiny shape (short prefixes).
# A GPU machine without Ray gets it from .devsite/site.tar.xz (tools/device_site.sh builds it; the device
# tool carries it: carry [".devsite"]).
# PARTS picks what runs: bench (step 1), serve (steps 2 and 3) or all (the default); SHAPES=llama-3.2-1b
# runs step 1 at the 1B shape alone (for a short device budget). Each bench_size row is
# written as it is measured (OUT_DIR/SHAPE/size.json), so a run stopped at its limit keeps what it measured.
#   bash tools/gpu_size.sh [OUT_DIR] [PARTS]
set -o pipefail
OUT=$(realpath -m "${1:-runs/gpu-size}")
PARTS=${2:-all}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
WORK=$(mktemp -d /tmp/scd-gpu-size.XXXX)
step() { echo "== $1 ($(date +%T))" | tee -a "$OUT/steps.log"; }
if ! python3 -c "import ray" 2>/dev/null && [ -f .devsite/site.tar.xz ]; then
  mkdir -p /tmp/scd-site && for t in .devsite/*.tar.xz; do tar -C /tmp/scd-site -xJf "$t"; done
  export PYTHONPATH=/tmp/scd-site${PYTHONPATH:+:$PYTHONPATH}
fi

if python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  nvidia-smi -L 2>&1 | tee "$OUT/device.txt"
  SHAPES=${SHAPES:-"llama-3.2-1b llama-3.1-8b"}; TOKENS=4096,16384,32768; PROFILE=16384
  FAMILY=configs/timing-8b.yaml; PREFIX=4096; PAYLOADS_MB=54,215,430    # codes at 0.1 of 4k, 16k, 32k
  OVERHEAD=configs/timing-1b.yaml
else
  echo "no CUDA device: a rehearsal on CPU at the tiny shape" | tee "$OUT/device.txt"
  SHAPES="tiny"; TOKENS=256,512; PROFILE=512; FAMILY=configs/timing-tiny.yaml; PREFIX=256; OVERHEAD=$FAMILY
  PAYLOADS_MB=0.1,1
fi
python3 -c "import torch, ray; print('torch', torch.__version__, 'ray', ray.__version__)" 2>&1 | tee -a "$OUT/device.txt"

# A config with its artifacts in WORK, and the family's random artifacts published there: family CONFIG OUT_YAML
family() {
  python3 - "$1" "$2" "$WORK/store" <<'EOF'
import sys, yaml
from pathlib import Path
raw = yaml.safe_load(Path(sys.argv[1]).read_text())
raw["artifacts"] = {"uri": sys.argv[3]}
Path(sys.argv[2]).write_text(yaml.safe_dump(raw))
EOF
  python3 -m jobs.timing_family --config "$2" 2>&1 | tee -a "$OUT/timing_family.log"
}

if [ "$PARTS" != serve ] && python3 -c "import pytest" 2>/dev/null; then
  step "the static decode caches' CUDA graphs against the eager steps"   # what the decode figures rest on
  timeout 120 python3 -m pytest -q -o addopts="" -p no:warnings -p no:cacheprovider tests/test_static_batch.py \
    tests/test_gpu.py -k "static or greedy" 2>&1 | tail -5 | tee "$OUT/static_tests.log"
fi
for shape in $SHAPES; do
  [ "$PARTS" = serve ] && break
  step "bench_size $shape"
  timeout 200 python3 -m tools.bench_size --shape "$shape" --tokens "$TOKENS" --repeats 3 --out "$OUT/$shape" \
    --profile "$PROFILE" \
    2>&1 | tee "$OUT/bench_size_$shape.log"
done

if [ "$PARTS" != serve ]; then
  step "bench_transport at the 8B shape's payload sizes"
  timeout 120 python3 -m tools.bench_transport --sizes-mb "$PAYLOADS_MB" --repeats 5 --json "$OUT/transport.json" \
    2>&1 | tee "$OUT/transport.log"
fi
if [ "$PARTS" = bench ]; then step "done"; rm -rf "$WORK"; exit 0; fi

step "timing family served: $FAMILY"
family "$FAMILY" "$WORK/family.yaml"
python3 -m cli.main serve --config "$WORK/family.yaml" > "$OUT/serve.log" 2>&1 &
SERVE=$!
for _ in $(seq 180); do grep -q "Serve ready on" "$OUT/serve.log" && break; kill -0 $SERVE 2>/dev/null || break; sleep 1; done
if grep -q "Serve ready on" "$OUT/serve.log"; then
  timeout 120 python3 -m cli.main loadtest --requests 64 --concurrency 8 --prefix-tokens "$PREFIX" --compare \
    > "$OUT/loadtest.json" 2> "$OUT/loadtest.err"
  python3 -c "import urllib.request; print(urllib.request.urlopen('http://127.0.0.1:8000/healthz').read().decode())" \
    > "$OUT/healthz.json"
fi
kill -TERM $SERVE 2>/dev/null; wait $SERVE; echo "scd serve exited $?" | tee -a "$OUT/steps.log"

step "bench_overhead: $OVERHEAD"
family "$OVERHEAD" "$WORK/overhead.yaml"
timeout 120 python3 -m tools.bench_overhead --config "$WORK/overhead.yaml" --n 100 2>&1 | tee "$OUT/overhead.log"
if [ "$SECONDS" -lt 450 ]; then     # time left in the run's 9 minutes: the same with the codes in their tickets
  step "bench_overhead: $OVERHEAD, payloads of up to 1 MiB in their tickets (no pull)"
  python3 - "$WORK/overhead.yaml" "$WORK/overhead_inline.yaml" <<'EOF'
import sys, yaml
from pathlib import Path
raw = yaml.safe_load(Path(sys.argv[1]).read_text())
raw["transport_inline_bytes"] = 1 << 20
Path(sys.argv[2]).write_text(yaml.safe_dump(raw))
EOF
  timeout 120 python3 -m tools.bench_overhead --config "$WORK/overhead_inline.yaml" --n 100 2>&1 \
    | tee "$OUT/overhead_inline.log"
fi
step "done"
rm -rf "$WORK"
