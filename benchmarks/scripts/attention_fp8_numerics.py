"""One-off: the attention output's relative error against exact fp32 attention (random unit-norm
queries and keys scaled by a temperature, 128-dim heads, 4 query heads) for the FP8 KV cache's
kernels, emulated in PyTorch: "kv8" e4m3 K / V with per-token scales, fp16 query and
probabilities (the widening kernel); "+q8" / "+p8" the query / probabilities rounded to e4m3
once; "q8x2+p8x2" both split into two e4m3 terms (shoal.kernels.paged_attention_fp8).
Run: python benchmarks/scripts/attention_fp8_numerics.py (CPU, ~1 min)."""
import torch
torch.manual_seed(0)
E4 = torch.float8_e4m3fn
def q8(x):  # per-row 448 scaling
    a = x.abs().amax(-1, keepdim=True).clamp_min(1e-10); s = 448.0 / a
    return (x * s).clamp(-448, 448).to(E4).float() / s
def run(T=1024, D=128, G=4, temp=1.0, trials=20):
    errs = {"kv8": [], "kv8+q8": [], "kv8+q8+p8": [], "kv8+p8": []}
    for _ in range(trials):
        q = torch.randn(G, D); k = torch.randn(T, D); v = torch.randn(T, D)
        q = q / q.norm(dim=-1, keepdim=True) * (D ** 0.5) * temp
        k = k / k.norm(dim=-1, keepdim=True) * (D ** 0.5)
        q = q.bfloat16().float(); k = k.bfloat16().float(); v = v.bfloat16().float()
        sc = D ** -0.5
        ref = torch.softmax(q @ k.T * sc, -1) @ v
        k8, v8 = q8(k), q8(v)
        def attn(qq, pq):
            s = qq @ k8.T * sc
            p = torch.exp(s - s.max(-1, keepdim=True).values)
            l = p.sum(-1, keepdim=True)
            if pq == "p8":
                p = (p * 256).to(E4).float() / 256
            else:
                p = p.half().float()
            return (p @ v8) / l
        outs = {"kv8": attn(q.half().float(), None), "kv8+q8": attn(q8(q), None),
                "kv8+q8+p8": attn(q8(q), "p8"), "kv8+p8": attn(q.half().float(), "p8")}
        for kk, o in outs.items():
            errs[kk].append(((o - ref).norm() / ref.norm()).item())
    return {kk: sum(v) / len(v) for kk, v in errs.items()}
for temp in (0.5, 1.0, 2.0, 4.0):
    for T in (128, 1024):
        r = run(T=T, temp=temp)
        print(f"temp {temp} T {T}: " + "  ".join(f"{k} {v:.4f}" for k, v in r.items()))
print("hi/lo split")
def split8(x, s):  # x*s -> hi + lo/16 (both e4m3), returns reconstruction / s
    y = x * s; hi = y.to(E4).float(); lo = ((y - hi) * 16).to(E4).float()
    return (hi + lo / 16) / s
def run2(T=1024, D=128, G=4, temp=1.0, trials=20):
    e = {"kv8": [], "kv8+q8x2+p8x2": []}
    for _ in range(trials):
        q = torch.randn(G, D); k = torch.randn(T, D); v = torch.randn(T, D)
        q = q / q.norm(dim=-1, keepdim=True) * (D ** 0.5) * temp
        k = k / k.norm(dim=-1, keepdim=True) * (D ** 0.5)
        q = q.bfloat16().float(); k = k.bfloat16().float(); v = v.bfloat16().float()
        sc = D ** -0.5
        ref = torch.softmax(q @ k.T * sc, -1) @ v
        k8, v8 = q8(k), q8(v)
        for name in e:
            if name == "kv8": qq = q.half().float()
            else: qq = split8(q, 448.0 / q.abs().amax(-1, keepdim=True))
            s = qq @ k8.T * sc
            p = torch.exp(s - s.max(-1, keepdim=True).values); l = p.sum(-1, keepdim=True)
            p = p.half().float() if name == "kv8" else split8(p, 256.0)
            o = (p @ v8) / l
            e[name].append(((o - ref).norm() / ref.norm()).item())
    return {k: sum(v)/len(v) for k, v in e.items()}
for temp in (0.5, 1.0, 4.0):
    print(temp, run2(temp=temp))
