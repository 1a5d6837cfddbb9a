python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SHOAL_COMMIT=ec66102
timeout 150 python3 -m pytest -q tests/test_codec_conv.py -k "gpu_snake_epilogue_modes" 2>&1 | tail -3
timeout 240 python3 -m shoal.bench.kernels_codec_conv --points 64x32,1x8,64x8 --skip snake,convs,trace,profile,epilogue --backends triton,triton_epilogue_k1,triton_epilogue --out $OUT/codec-modes.json 2>&1 | grep decode
python3 - <<'PY' > /tmp/mode.txt
import json, os
d = json.load(open(os.environ["OUT"] + "/codec-modes.json"))
r = {x["backend"]: x.get("call_ms", 1e9) for x in d["decode"] if x["batch"] == 64 and x["frames"] == 32}
best = min(r, key=r.get)
print({"triton": "0", "triton_epilogue": "1", "triton_epilogue_k1": "k1"}[best])
PY
echo "best mode $(cat /tmp/mode.txt)"
SHOAL_CODEC_CONV_EPILOGUE=$(cat /tmp/mode.txt) timeout 150 python3 -m shoal.bench.engine --concurrency 64 --frames 300 --requests-per-client 2 --audio --voices 4 --out $OUT/eng-audio-mode 2>&1 | grep "c=" | tail -2
