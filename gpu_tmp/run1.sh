set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SHOAL_COMMIT=$1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 150 python3 -m pytest -q -x tests/test_dense_gemm.py -k gpu 2>&1 | tail -5
timeout 330 python3 -m shoal.bench.tune_dense --out $OUT/tune --jobs 14 2>&1 | grep -v "^precompiled" | tail -45
ls $OUT/tune
export SHOAL_DENSE_TUNED=$OUT/tune/dense_tuned.json
timeout 100 python3 -m shoal.bench.engine --concurrency 1,64 --frames 300 --requests-per-client 2 --out $OUT/eng-dense 2>&1 | tail -8
