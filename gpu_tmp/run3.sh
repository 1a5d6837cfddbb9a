python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 SHOAL_COMMIT=COMMIT
timeout 330 python3 -m shoal.bench.kernels_codec_conv --points 64x32,1x8,64x8 --skip snake,convs,trace,profile --backends triton,triton_epilogue --out $OUT/codec-epilogue.json 2>&1 | grep -v "^\s*$" | tail -30
python3 - <<'PY' > /tmp/win.txt
import json, os
d = json.load(open(os.environ["OUT"] + "/codec-epilogue.json"))
r = {(x["backend"], x["batch"], x["frames"]): x.get("call_ms", 1e9) for x in d["decode"]}
print("yes" if r.get(("triton_epilogue", 64, 32), 1e9) < 0.97 * r.get(("triton", 64, 32), 0) else "no")
PY
cat /tmp/win.txt
if [ "$(cat /tmp/win.txt)" = yes ]; then
  for e in 1 0; do
    SHOAL_CODEC_CONV_EPILOGUE=$e timeout 200 python3 -m shoal.bench.engine --concurrency 64 --frames 300 --requests-per-client 2 --audio --voices 4 --out $OUT/eng-audio-epi$e 2>&1 | grep -i "c=64\|aggregate\|fps\|error" | tail -4
  done
fi
