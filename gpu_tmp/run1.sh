set -x
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SHOAL_COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo c1)
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv
timeout 150 python3 -m pytest -q -x tests/test_dense_gemm.py -k gpu 2>&1 | tail -5
timeout 100 python3 -m pytest -q tests/test_fp8_kernels.py -k gpu_swap_kb_step 2>&1 | tail -3
timeout 330 python3 -m shoal.bench.tune_dense --ms 64,1 --shapes down,wo,wqkv,gate_up,semantic_head,fast_head --jobs 15 --out $OUT/tune 2>&1 | grep -v "^\s*$" | tail -20
