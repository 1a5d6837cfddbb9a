#!/usr/bin/env bash
# The HTTP (`shoal bench serve`) and realtime (`shoal bench live`) benchmarks on the lent GPU:
# `shoal serve --random-model s2-pro` (random weights at the real S2-Pro shapes) in the
# background, both sweeps against it, the server stopped at the end (see shoal/bench/serve_gpu.py).
#
#   bash scripts/gpu-bench-serve.sh "$OUT" [--profile quick|full] [--skip-live|--skip-serve]
#
# Carry `.whl` (scripts/gpu-wheels.sh): its wheels are installed into /tmp/site first. Writes
# serve.json/png, live.json/png, server.log, metrics.prom and summary.json into OUT. The quick
# profile (default) ends within 500 s; set SHOAL_COMMIT to record the commit measured
# (SHOAL_SKIP_WHEELS=1: no wheel install, e.g. a CPU try with `--profile smoke --device cpu`).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${1:?usage: gpu-bench-serve.sh OUT [serve_gpu options]}"
shift
if [[ -z "${SHOAL_SKIP_WHEELS:-}" ]] && compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu-bench-serve: installing .whl into /tmp/site failed" >&2; exit 2; }
fi
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 -m shoal.bench.serve_gpu "$out" "$@"
