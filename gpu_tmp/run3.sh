python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SHOAL_COMMIT=$1
timeout 170 python3 -m pytest -q -x tests/test_dense_gemm.py -k gpu 2>&1 | tail -4
timeout 240 python3 -m shoal.bench.tune_dense --out $OUT/tune --jobs 14 2>&1 | grep -v "^precompiled" | tail -40
export SHOAL_DENSE_TUNED=$OUT/tune/dense_tuned.json
echo "=== bf16 dense tma"; timeout 75 python3 -m shoal.bench.engine --concurrency 1,64 --frames 300 --requests-per-client 2 --out $OUT/eng-bf16 2>&1 | grep "^c="
timeout 100 python3 -m shoal.cli bench gate --baseline benchmarks/baselines/h200.json --json $OUT/gate.json 2>&1 | tail -6
