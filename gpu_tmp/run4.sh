python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SHOAL_COMMIT=$1
timeout 170 python3 -m pytest -q -x tests/test_pdl_gpu.py tests/test_dense_gemm.py -k gpu 2>&1 | tail -4
for pdl in 0 1; do echo "=== bf16 PDL=$pdl"; SHOAL_PDL=$pdl timeout 75 python3 -m shoal.bench.engine --concurrency 1,64 --frames 300 --requests-per-client 2 --out $OUT/eng-bf16-pdl$pdl 2>&1 | grep "^c="; done
echo "=== fp8 PDL=1"; SHOAL_PDL=1 timeout 85 python3 -m shoal.bench.engine --quantization fp8 --concurrency 1,64 --frames 300 --requests-per-client 2 --out $OUT/eng-fp8-pdl1 2>&1 | grep "^c="
