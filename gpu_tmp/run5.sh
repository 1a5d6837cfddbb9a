python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SHOAL_COMMIT=$1
timeout 130 python3 -m pytest -q tests/test_fused_kernels.py tests/test_sampling_kernels.py tests/test_paged_attention.py tests/test_fp8_kernels.py tests/test_fp8_fusion.py tests/test_kv_fp8.py -k gpu 2>&1 | tail -4
timeout 95 python3 -m shoal.cli bench gate --baseline benchmarks/baselines/h200.json --json $OUT/gate.json 2>&1 | tail -6
timeout 65 python3 -m shoal.bench.engine --audio --concurrency 64 --frames 300 --requests-per-client 2 --voices 4 --out $OUT/eng-audio-v4 2>&1 | grep "^c="
