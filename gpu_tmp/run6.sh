python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SHOAL_COMMIT=2b4d487
timeout 150 python3 -m shoal.cli bench gate --baseline benchmarks/baselines/h200.json --repeats 1 --json $OUT/gate.json 2>&1 | tail -6
timeout 130 python3 -m shoal.bench.engine --concurrency 64 --frames 300 --requests-per-client 2 --audio --voices 4 --out $OUT/eng-audio 2>&1 | grep "c=" | tail -2
timeout 150 python3 -m shoal.cli bench codec --dtypes bf16 --batches 1,64 --chunks 8,32 --modes graph --skip latency,oneshot,variants,exactness,encoder --out $OUT/codec 2>&1 | tail -8
