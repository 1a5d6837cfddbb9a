python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SHOAL_COMMIT=8b4c490
timeout 120 python3 -m pytest -q tests/test_sampling_kernels.py -k gpu 2>&1 | tail -3
timeout 90 python3 -m shoal.bench.kernels_sampling --batch 1,64 --out $OUT/ksamp 2>&1 | tail -6
timeout 150 python3 -m shoal.bench.engine --concurrency 1,64 --frames 300 --requests-per-client 2 --out $OUT/eng-bf16 2>&1 | grep "c=" | tail -3
timeout 170 python3 -m shoal.bench.engine --quantization fp8 --concurrency 1,64 --frames 300 --requests-per-client 2 --out $OUT/eng-fp8 2>&1 | grep "c=" | tail -3
