#!/usr/bin/env bash
# Builds .devsite/: what a lent GPU machine lacks to run tools/gpu_size.sh (its image has torch, transformers,
# peft, safetensors, pyarrow, but not Ray, Serve's web stack, pydantic or zstandard), as two xz tarballs that
# gpu_size.sh unpacks into /tmp/scd-site when `import ray` fails there. A call carries at most 64 MiB with the
# repository (about 38 MiB), so Ray goes stripped: no Java, RLlib, Tune, Train, Data or LLM, no dashboard
# source maps, its three binaries without symbols (about 24 MB in all). Python 3.12, x86-64 (the machine's).
#   bash tools/device_site.sh            # then: the device tool's run with carry [".devsite"]
# .devsite/ is ignored by git (.git/info/exclude): nothing here is committed.
set -euo pipefail
ROOT=$(git rev-parse --show-toplevel)
DL=$(mktemp -d /tmp/scd-devsite-dl.XXXX)
SITE=$(mktemp -d /tmp/scd-devsite.XXXX)
FIX=$(mktemp -d /tmp/scd-devsite-fix.XXXX)
trap 'rm -rf "$DL" "$SITE" "$FIX"' EXIT
PLAT=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform any)

# Ray with Serve's dependencies, less what the machine's image holds (KINDS.md's package list)
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$DL" ray==2.60.0 jsonschema jsonschema-specifications \
  referencing rpds-py fastapi starlette annotated-doc uvicorn httptools websockets watchfiles python-dotenv \
  pydantic pydantic-core typing-inspection annotated-types opentelemetry-api opentelemetry-sdk \
  opentelemetry-semantic-conventions opentelemetry-proto opentelemetry-exporter-prometheus opencensus \
  opencensus-context google-api-core google-auth googleapis-common-protos proto-plus pyasn1 pyasn1-modules \
  colorful aiohttp-cors smart-open mmh3 platformdirs
for w in "$DL"/*.whl; do unzip -q -o "$w" -d "$SITE"; done
( cd "$SITE/ray" && rm -rf jars rllib tune train data llm air tests workflow util/dask \
    dashboard/client/build/static/js/*.map )
strip "$SITE/ray/_raylet.so" "$SITE/ray/core/src/ray/gcs/gcs_server" "$SITE/ray/core/src/ray/raylet/raylet"

# unpacked after the site: zstandard (the codec), protobuf as tested here, and a grpcio-reflection that matches
# the image's grpcio (1.84: Serve imports it, and a newer one refuses that grpcio)
python3 -m pip download -q --no-deps "${PLAT[@]}" -d "$FIX" zstandard "grpcio-reflection==1.84.0" \
  "protobuf==$(python3 -c 'import google.protobuf as p; print(p.__version__)')"
for w in "$FIX"/*.whl; do unzip -q -o "$w" -d "$FIX/site"; done
rm -f "$FIX"/site/zstandard/_cffi*.so "$FIX"/site/zstandard/backend_cffi.py
strip "$FIX"/site/zstandard/backend_c*.so

mkdir -p "$ROOT/.devsite"
grep -qx "/.devsite/" "$ROOT/.git/info/exclude" 2>/dev/null || echo "/.devsite/" >> "$ROOT/.git/info/exclude"
tar -C "$SITE" -cf - . | xz -9 -T0 > "$ROOT/.devsite/site.tar.xz"
tar -C "$FIX/site" -cf - . | xz -9 > "$ROOT/.devsite/update.tar.xz"    # after site.tar.xz: names sort so
ls -l "$ROOT/.devsite"
