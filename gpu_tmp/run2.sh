python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SHOAL_COMMIT=$1
E=shoal.bench.engine
timeout 120 python3 -m shoal.bench.tune_dense --ms 64,128 --out $OUT/tune64 --jobs 14 2>&1 | grep -v "^precompiled" | tail -14
python3 - <<'P'
import json, os
a = json.load(open("gpu_tmp/dense_run1.json"))
b = json.load(open(os.environ["OUT"] + "/tune64/dense_tuned.json"))
for k, v in b["configs"].items():
    a["configs"].setdefault(k, {}).update(v)
a["commit"] = os.environ["SHOAL_COMMIT"]
json.dump(a, open(os.environ["OUT"] + "/dense_tuned.json", "w"), indent=1)
print({k: {m: (c and f"{c['BLOCK_N']}x{c['BLOCK_M']}x{c['BLOCK_K']}") for m, c in v.items()} for k, v in a["configs"].items()})
P
export SHOAL_DENSE_TUNED=$OUT/dense_tuned.json
echo "=== bf16 dense"; timeout 75 python3 -m $E --concurrency 1,64 --frames 300 --requests-per-client 2 --out $OUT/eng-bf16 2>&1 | grep "^c="
echo "=== bf16 cublas"; SHOAL_DENSE_GEMM=0 timeout 75 python3 -m $E --concurrency 1,64 --frames 300 --requests-per-client 2 --out $OUT/eng-bf16-cublas 2>&1 | grep "^c="
echo "=== fp8 dense heads"; timeout 80 python3 -m $E --quantization fp8 --concurrency 1,64 --frames 300 --requests-per-client 2 --out $OUT/eng-fp8 2>&1 | grep "^c="
echo "=== bf16 audio voices4"; timeout 90 python3 -m $E --audio --concurrency 1,64 --frames 300 --requests-per-client 2 --voices 4 --out $OUT/eng-audio-v4 2>&1 | grep "^c=\|underrun"
echo "=== bf16 audio voices0"; timeout 80 python3 -m $E --audio --concurrency 64 --frames 300 --requests-per-client 2 --out $OUT/eng-audio-v0 2>&1 | grep "^c=\|underrun"
