#!/usr/bin/env bash
# Download, into .whl/, the Python wheels that the lent GPU machine's image lacks, so that the
# server, codec and benchmarks run there (the device tool carries `.whl` with `carry: [".whl"]`;
# start the device command with:
#   python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
# ). The GPU image has Python 3.12 with torch, triton, numpy, tokenizers, tiktoken, safetensors,
# tqdm, httpx, anyio, h11, prometheus-client and matplotlib already (httpx-ws: `shoal bench live`).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
pkgs=(soundfile soxr cffi pycparser fastapi starlette pydantic pydantic-core annotated-types
      typing-inspection annotated-doc opentelemetry-api uvicorn ormsgpack python-multipart
      wsproto av num2words httpx-ws)
for p in "${pkgs[@]}"; do
  v=$(python3 -m pip show "$p" 2>/dev/null | sed -n 's/^Version: //p' || true)
  spec="$p${v:+==$v}"   # the versions tested here when installed, else the latest
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "$spec"
done
du -sh .whl
