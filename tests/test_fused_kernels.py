"""Fused decode-step kernels (shoal.kernels.fused): Triton kernels vs PyTorch references,
and references vs the model code they replace (shoal/model/layers.py, engine/attention.py).

As in test_paged_attention.py, the interpreter cases run in one subprocess -- this file
executed as a script, with ``TRITON_INTERPRET=1`` set before anything imports triton --
and each case's checks are asserted by its own parametrized test here.

Numerics checked (see the module docstring of shoal.kernels.fused):
* fp32: ``max|kernel - ref| <= 1e-6 * max|ref|``.
* bf16, purely elementwise results (residual sum h, SiLU-mul, RoPE without qk-norm, V
  copy): bit-exact.
* bf16 results behind a reduction (RMSNorm, qk-norm): at most 2 bf16 ulp and at most 1%
  of the elements differing (the sum of squares is added in another order); in practice
  0 mismatches at these sizes.
* fast attention: within 1e-5 (fp32) / one bf16 rounding (bf16) of the reference.
"""

import os

if __name__ == "__main__":  # interpreter worker: must precede the first triton import
    os.environ["TRITON_INTERPRET"] = "1"

import zlib

import pytest
import torch
import torch.nn.functional as F
from interpreter_worker import assert_case, report_cases, run_worker

from shoal.kernels import fused as fz
from shoal.model.layers import Attention, Block, FeedForward, RMSNorm, rope_table

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# --------------------------------------------------------------------------------------
# Helpers shared by the worker, the CPU tests and the GPU tests
# --------------------------------------------------------------------------------------


def ulp_diff(a, b):
    """Elementwise distance in units in the last place (bf16/fp16: int16 bit patterns)."""
    assert a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16)
    ai = a.contiguous().view(torch.int16).to(torch.int32)
    bi = b.contiguous().view(torch.int16).to(torch.int32)
    ai = torch.where(ai < 0, -32768 - ai, ai)  # sign-magnitude -> monotonic
    bi = torch.where(bi < 0, -32768 - bi, bi)
    return (ai - bi).abs()


def compare(a, b, exact_bf16):
    """{'metric': (value, limit)} comparing kernel output a with reference b."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return {"dtype_shape_match": (1.0, 0.0)}
    if a.dtype == torch.float32:
        scale = b.abs().max().item() or 1.0
        return {"rel_err": ((a - b).abs().max().item() / scale, 1e-6)}
    if exact_bf16:
        return {"mismatches": (float((a != b).sum().item()), 0.0)}
    u = ulp_diff(a, b)
    # ulps mean little on cancellation-small outputs (RoPE's x cos - y sin near 0, where one
    # fp32 rounding of a product moves the result by many of its own ulps): the ulp bound covers
    # outputs above 1/64 of the largest, an absolute bound the rest
    big = b.float().abs() >= b.float().abs().max() / 64
    return {"max_ulp": (float(u[big].max().item()) if big.any() else 0.0, 2.0),
            "max_abs_rel_to_max": ((a.float() - b.float()).abs().max().item()
                                   / (b.float().abs().max().item() or 1.0), 2.0 ** -8),
            "mismatch_frac": ((u > 0).float().mean().item(), 1e-2)}


def rand(shape, dtype, g, scale=1.0, device="cpu"):
    return (torch.randn(shape, generator=g) * scale).to(device=device, dtype=dtype)


def qk_case(N, H, H_kv, D, dtype, norm, *, seed=0, device="cpu", num_blocks=6, block_size=8,
            neg_slot=False, strided=False, table_len=4096, base=1e6):
    """Inputs of qk_norm_rope_write: qkv, positions, table, weights, NaN-poisoned caches,
    distinct random slots (one -1 when ``neg_slot``)."""
    g = torch.Generator().manual_seed(seed)
    width = (H + 2 * H_kv) * D
    if strided:  # rows of a wider buffer
        big = rand((N, width + 3 * D), dtype, g, 2.0, device)
        qkv = big[:, D: D + width]
    else:
        qkv = rand((N, width), dtype, g, 2.0, device)
    positions = torch.randint(0, table_len, (N,), generator=g).to(device)
    table = rope_table(table_len, D, base).to(device)
    qw = rand((D,), dtype, g, 0.3, device) + 1 if norm else None
    kw = rand((D,), dtype, g, 0.3, device) + 1 if norm else None
    # caches as one layer of a PagedKVCache-like [layers, 2, blocks, bs, H_kv, D] tensor
    data = torch.full((2, 2, num_blocks, block_size, H_kv, D), float("nan"), dtype=dtype, device=device)
    k_cache, v_cache = data[1, 0], data[1, 1]
    slots = torch.randperm(num_blocks * block_size, generator=g)[:N].to(device)
    if neg_slot:
        slots[N // 2] = -1
    return qkv, positions, table, qw, kw, data, k_cache, v_cache, slots


def run_qk(fn, case, H, H_kv, D, eps=1e-6):
    qkv, positions, table, qw, kw, data, k_cache, v_cache, slots = case
    data = data.clone()
    k_cache, v_cache = data[1, 0], data[1, 1]
    q = fn(qkv, positions, table, qw, kw, eps, k_cache, v_cache, slots, H, H_kv, D)
    return q, data


# --------------------------------------------------------------------------------------
# Interpreter cases (run in the worker subprocess)
# --------------------------------------------------------------------------------------

# name -> spec
INTERP_CASES = {}
for _dt in ("fp32", "bf16"):
    for _dim, _lead, _res in ((64, (5,), True), (320, (2, 3), True), (512, (4,), False), (2560, (3,), True)):
        INTERP_CASES[f"add_rmsnorm_{_dt}_d{_dim}_{'res' if _res else 'nores'}"] = ("add_rmsnorm", _dt, _dim, _lead, _res)
    for (_h, _hkv, _d) in ((4, 2, 32), (4, 2, 64), (4, 2, 128), (32, 8, 128)):
        for _norm in (False, True):
            INTERP_CASES[f"qk_{_dt}_h{_h}_kv{_hkv}_d{_d}_{'norm' if _norm else 'nonorm'}"] = ("qk", _dt, _h, _hkv, _d, _norm)
    for _inter, _block in ((64, 1024), (700, 128), (1000, 1024)):
        INTERP_CASES[f"silu_mul_{_dt}_i{_inter}_b{_block}"] = ("silu_mul", _dt, _inter, _block)
    for (_h, _hkv, _d, _len) in ((4, 2, 32, 1), (4, 2, 64, 5), (8, 2, 32, 10), (4, 4, 128, 7), (6, 2, 64, 3)):
        INTERP_CASES[f"fast_attn_{_dt}_h{_h}_kv{_hkv}_d{_d}_len{_len}"] = ("fast_attn", _dt, _h, _hkv, _d, _len)
    for (_h, _hkv, _d, _len) in ((4, 2, 32, 1), (4, 2, 64, 5), (8, 2, 32, 10), (6, 2, 64, 3), (8, 2, 128, 4),
                                 (6, 2, 128, 3)):  # a group of 3 heads, padded to 4 lanes
        INTERP_CASES[f"fast_rope_attn_{_dt}_h{_h}_kv{_hkv}_d{_d}_len{_len}"] = ("fast_rope_attn", _dt, _h, _hkv, _d, _len)
EXTRA_CASES = [
    "add_rmsnorm_bf16_fp32_weight",
    "add_rmsnorm_inplace_h_out",
    "qk_bf16_neg_slot_strided",
    "qk_fp32_neg_slot_strided_norm",
    "public_dispatch",
    "qk_rows_bf16_norm_neg_slot",
    "qk_rows_fp32_nonorm_strided",
    "qk_rows_fp8_token_minor",
    "qk_rows_fp8_standard_d128",
    "qk_rows_fp16_d128_norm",
]


def _restore_env(key, value):
    import os

    if value is None:
        os.environ.pop(key, None)
    else:
        os.environ[key] = value


def _qk_both_forms(fn):
    """``fn()`` with the rows form of the qk-norm kernel (SHOAL_QKNORM_ROWS=8, from 64 rows here)
    and with one token per program (=0, the default), and the kernel names each launched."""
    import os

    names = []
    orig = fz._kernel

    def spy(name):
        names.append(name)
        return orig(name)

    outs = []
    fz._kernel = spy
    low, fz.QK_NORM_ROWS_MIN = fz.QK_NORM_ROWS_MIN, 64  # small cases: the rows form from 64 rows
    before = os.environ.get(fz.QK_NORM_ROWS_ENV)
    try:
        for rows in ("8", "0"):
            os.environ[fz.QK_NORM_ROWS_ENV] = rows
            fz.qk_norm_rows_block.cache_clear()
            outs.append(fn())
    finally:
        fz._kernel = orig
        fz.QK_NORM_ROWS_MIN = low
        _restore_env(fz.QK_NORM_ROWS_ENV, before)
        fz.qk_norm_rows_block.cache_clear()
    return outs, names


def _qk_rows_case(name, seed, g):
    """The rows form (8 tokens x one head per program) against one token per program: the same
    bits for q and both caches, padding rows skipped, a ragged last block."""
    checks, flags = {}, {}
    if name.startswith("qk_rows_fp8"):
        from shoal.kernels.paged_attention_fp8 import token_minor_like

        minor = name == "qk_rows_fp8_token_minor"
        H, H_kv, D, N, nb, bs = 4, 2, (64 if minor else 128), 70, 8, 16
        qkv = rand((N, (H + 2 * H_kv) * D), torch.bfloat16, g, 3.0)
        pos = torch.randint(0, 60, (N,), generator=g)
        tab = rope_table(64, D, 10000.0).to(torch.bfloat16)
        qw = rand((D,), torch.bfloat16, g, 0.3) + 1
        kw = rand((D,), torch.bfloat16, g, 0.3) + 1
        slots = torch.randperm(nb * bs, generator=g)[:N]
        slots[5] = -1

        def run():
            kc = torch.zeros(nb, bs, H_kv, D, dtype=torch.float8_e4m3fn)
            vc = token_minor_like(kc.shape, "cpu") if minor else torch.zeros_like(kc)
            ks, vs = torch.zeros(nb, bs, H_kv), torch.zeros(nb, bs, H_kv)
            q = fz.qk_norm_rope_write_triton(qkv, pos, tab, qw, kw, 1e-6, kc, vc, slots, H, H_kv, D,
                                             k_scale=ks, v_scale=vs)
            return q, kc.view(torch.uint8).clone(), vc.contiguous().view(torch.uint8), ks, vs

        outs, names = _qk_both_forms(run)
        for label, a, b in zip(("q", "k", "v", "k_scale", "v_scale"), outs[0], outs[1]):
            flags[f"{label}_same_bits"] = torch.equal(a, b)
        flags["fp8_written"] = bool((outs[0][1] != 0).any())
    else:
        dt = torch.bfloat16 if "bf16" in name else torch.float16 if "fp16" in name else torch.float32
        norm = "_norm" in name
        H, H_kv, D = 4, 2, (128 if "d128" in name else 64)
        case = qk_case(70, H, H_kv, D, dt, norm, seed=seed, num_blocks=12, neg_slot="neg_slot" in name,
                       strided="strided" in name, base=1e4)
        outs, names = _qk_both_forms(lambda: run_qk(fz.qk_norm_rope_write_triton, case, H, H_kv, D))
        flags["q_same_bits"] = torch.equal(outs[0][0], outs[1][0])
        flags["caches_same_bits"] = torch.equal(outs[0][1].nan_to_num(7.0), outs[1][1].nan_to_num(7.0))
        qr, datar = run_qk(fz.qk_norm_rope_write_ref, case, H, H_kv, D) if "neg_slot" not in name else (None, None)
        if qr is not None:
            checks.update({f"q_{k}": v for k, v in compare(outs[0][0], qr, not norm).items()})
    flags["rows_form_ran"] = names[:1] == ["_qk_norm_rope_write_rows_kernel"]
    if name == "qk_rows_bf16_norm_neg_slot":  # decode-sized calls (below the threshold): one token per program
        qkv, pos, table, qw, kw, d0, _, _, slots = case
        import os

        seen = []
        orig = fz._kernel
        fz._kernel = lambda n: (seen.append(n), orig(n))[1]
        before = os.environ.get(fz.QK_NORM_ROWS_ENV)
        os.environ[fz.QK_NORM_ROWS_ENV] = "8"  # the rows form on: still not below the threshold
        fz.qk_norm_rows_block.cache_clear()
        try:
            fz.qk_norm_rope_write_triton(qkv[:64], pos[:64], table, qw, kw, 1e-6, d0[1, 0].clone(), d0[1, 1].clone(),
                                         slots[:64], H, H_kv, D)
        finally:
            fz._kernel = orig
            _restore_env(fz.QK_NORM_ROWS_ENV, before)
            fz.qk_norm_rows_block.cache_clear()
        flags["decode_sizes_per_token"] = seen == ["_qk_norm_rope_write_kernel"] and fz.QK_NORM_ROWS_MIN > 128
    flags["token_form_ran"] = names[1:] == ["_qk_norm_rope_write_kernel"]
    return {"checks": checks, "flags": flags}


def _interp_case(name):
    seed = zlib.crc32(name.encode()) % 10000
    g = torch.Generator().manual_seed(seed)
    checks, flags = {}, {}
    if name in INTERP_CASES:
        spec = INTERP_CASES[name]
        kind, dt = spec[0], _DTYPES[spec[1]]
        if kind == "add_rmsnorm":
            _, _, dim, lead, res = spec
            x = rand((*lead, dim), dt, g, 2.0)
            r = rand((*lead, dim), dt, g, 2.0) if res else None
            w = rand((dim,), dt, g, 0.2) + 1
            o, h = fz.add_rmsnorm_triton(x, r, w, 1e-6)
            ro, rh = fz.add_rmsnorm_ref(x, r, w, 1e-6)
            checks.update({f"normed_{k}": v for k, v in compare(o, ro, False).items()})
            flags["h_exact"] = torch.equal(h, rh)
            if r is None:
                flags["h_is_x"] = h is x
        elif kind == "qk":
            _, _, H, H_kv, D, norm = spec
            case = qk_case(3, H, H_kv, D, dt, norm, seed=seed)
            q, data = run_qk(fz.qk_norm_rope_write_triton, case, H, H_kv, D)
            qr, datar = run_qk(fz.qk_norm_rope_write_ref, case, H, H_kv, D)
            exact = not norm  # RoPE alone is elementwise: bit-exact; qk-norm has a reduction
            checks.update({f"q_{k}": v for k, v in compare(q, qr, exact).items()})
            _check_caches(case, data, datar, exact, checks, flags)
        elif kind == "silu_mul":
            _, _, inter, block = spec
            gu = rand((3, 2 * inter), dt, g, 3.0)
            o = fz.silu_mul_triton(gu, block=block)
            checks.update(compare(o, fz.silu_mul_ref(gu), True))
        elif kind == "fast_attn":
            _, _, H, H_kv, D, length = spec
            B, rows, C = 3, 5, 10
            q = rand((B, H, D), dt, g, 2.0)
            kv = rand((2, 2, rows, C, H_kv, D), dt, g)  # [layers, k/v, rows, C, H_kv, D]
            k_cache, v_cache = kv[1, 0], kv[1, 1]
            o = fz.fast_decode_attention_triton(q, k_cache, v_cache, length)
            r = fz.fast_decode_attention_ref(q, k_cache, v_cache, length)
            r32 = fz.fast_decode_attention_ref(q.float(), k_cache.float(), v_cache.float(), length)
            checks["err_vs_ref"] = ((o.float() - r.float()).abs().max().item(), 1e-5 if dt == torch.float32 else 2e-2)
            if dt == torch.float32:
                checks["err_vs_fp32_math"] = ((o - r32).abs().max().item(), 1e-5)
            else:  # the fp32 result rounded once: within 1 ulp of fp32 math rounded to bf16
                checks["ulp_vs_fp32_math"] = (float(ulp_diff(o, r32.to(dt)).max().item()), 1.0)
            flags["dtype"] = o.dtype == dt and o.shape == (B, H, D)
        elif kind == "fast_rope_attn":
            _, _, H, H_kv, D, length = spec
            B, rows, C = 3, 5, 10
            qkv = rand((B, (H + 2 * H_kv) * D), dt, g, 2.0)
            table = rand((C, D // 2, 2), dt, g)
            kv = rand((2, rows, C, H_kv, D), dt, g)  # [k/v, rows, C, H_kv, D]
            two, one, ref = kv.clone(), kv.clone(), kv.clone()
            # the two-kernel path: RoPE + K/V write, then the attention
            pos = torch.full((B,), length - 1, dtype=torch.long)
            slots = torch.arange(B) * C + (length - 1)
            q = fz.qk_norm_rope_write_triton(qkv, pos, table, None, None, 1e-6, two[0].view(rows * C, H_kv, D),
                                             two[1].view(rows * C, H_kv, D), slots, H, H_kv, D)
            want = fz.fast_decode_attention_triton(q, two[0], two[1], length)
            o = fz.fast_rope_attention_triton(qkv, table, one[0], one[1], length, H, H_kv, D)
            r = fz.fast_rope_attention_ref(qkv, table, ref[0], ref[1], length, H, H_kv, D)
            flags["same_bits_as_two_kernels"] = torch.equal(o, want)
            flags["same_caches_as_two_kernels"] = torch.equal(one, two)  # written slots, and nothing else
            flags["caches_as_reference"] = torch.equal(one, ref)
            checks["err_vs_ref"] = ((o.float() - r.float()).abs().max().item(), 1e-5 if dt == torch.float32 else 2e-2)
            flags["dtype"] = o.dtype == dt and o.shape == (B, H, D)
            if D == 128:  # the output also quantized for an FP8 wo: quantize_act's bytes, no launch
                from shoal.kernels import fp8

                q8 = torch.empty(B, H * D, dtype=torch.float8_e4m3fn)
                s8 = torch.empty(B, H, dtype=torch.float32)
                again = kv.clone()
                o2 = fz.fast_rope_attention_triton(qkv, table, again[0], again[1], length, H, H_kv, D,
                                                   quant_out=(q8, s8))
                rq, rs = fp8.quantize_act_triton(o.reshape(B, H * D))
                flags["quant_out_same_output"] = torch.equal(o2, o) and torch.equal(again, one)
                flags["quant_out_bytes"] = torch.equal(q8.view(torch.uint8), rq.view(torch.uint8))
                flags["quant_out_scales"] = torch.equal(s8, rs)
                flags["quant_out_not_trivial"] = bool(rs.min() > 0) and bool((rq.view(torch.uint8) != 0).any())
        else:
            raise KeyError(kind)
        return {"checks": checks, "flags": flags}

    if name == "add_rmsnorm_bf16_fp32_weight":  # bf16 activations, fp32 weight -> fp32 out
        x, r = rand((4, 256), torch.bfloat16, g, 2.0), rand((4, 256), torch.bfloat16, g, 2.0)
        w = rand((256,), torch.float32, g, 0.2) + 1
        o, h = fz.add_rmsnorm_triton(x, r, w, 1e-5)
        ro, rh = fz.add_rmsnorm_ref(x, r, w, 1e-5)
        flags["out_fp32"] = o.dtype == torch.float32 == ro.dtype
        # normed is rounded to bf16 before the fp32 multiply: exact unless that rounding flips
        checks["rel_err"] = ((o - ro).abs().max().item() / ro.abs().max().item(), 1e-2)
        checks["mismatch_frac"] = ((o != ro).float().mean().item(), 1e-2)
        flags["h_exact"] = torch.equal(h, rh)
    elif name == "add_rmsnorm_inplace_h_out":  # h written over the residual stream
        x, r = rand((6, 384), torch.bfloat16, g, 2.0), rand((6, 384), torch.bfloat16, g, 2.0)
        w = rand((384,), torch.bfloat16, g, 0.2) + 1
        ro, rh = fz.add_rmsnorm_ref(x, r, w, 1e-6)
        out = torch.empty_like(x)
        o, h = fz.add_rmsnorm_triton(x, r, w, 1e-6, out=out, h_out=r)
        flags["aliases"] = o is out and h is r
        flags["h_exact"] = torch.equal(r, rh)
        checks.update(compare(o, ro, False))
    elif name in ("qk_bf16_neg_slot_strided", "qk_fp32_neg_slot_strided_norm"):
        dt = torch.bfloat16 if "bf16" in name else torch.float32
        norm = name.endswith("_norm")
        H, H_kv, D = 4, 2, 64
        case = qk_case(5, H, H_kv, D, dt, norm, seed=seed, neg_slot=True, strided=True, base=1e4)
        q, data = run_qk(fz.qk_norm_rope_write_triton, case, H, H_kv, D)
        # reference without the padding token (index_copy_ needs valid slots)
        qkv, pos, table, qw, kw, d0, _, _, slots = case
        keep = slots >= 0
        datar = d0.clone()
        qr = fz.qk_norm_rope_write_ref(qkv[keep], pos[keep], table, qw, kw, 1e-6, datar[1, 0], datar[1, 1],
                                       slots[keep], H, H_kv, D)
        checks.update({f"q_{k}": v for k, v in compare(q[keep], qr, not norm).items()})
        q_pad = fz.qk_norm_rope_write_ref(qkv[~keep], pos[~keep], table, qw, kw, 1e-6, datar[0, 0].clone(),
                                          datar[0, 1].clone(), torch.zeros(1, dtype=torch.long), H, H_kv, D)
        checks.update({f"q_pad_{k}": v for k, v in compare(q[~keep], q_pad, not norm).items()})
        _check_caches(case, data, datar, not norm, checks, flags, slots=slots[keep])
    elif name.startswith("qk_rows_"):
        return _qk_rows_case(name, seed, g)
    elif name == "public_dispatch":
        flags["interpreting"] = fz.triton_interpreting() and fz.use_triton(torch.zeros(1))
        x = rand((2, 128), torch.bfloat16, g)
        w = rand((128,), torch.bfloat16, g) + 1
        o, h = fz.add_rmsnorm(x, x, w, 1e-6)
        ro, rh = fz.add_rmsnorm_ref(x, x, w, 1e-6)
        checks.update(compare(o, ro, False))
        flags["h"] = torch.equal(h, rh)
        gu = rand((2, 256), torch.bfloat16, g)
        flags["silu"] = torch.equal(fz.silu_mul(gu), fz.silu_mul_ref(gu))
    else:
        raise KeyError(name)
    return {"checks": checks, "flags": flags}


def _check_caches(case, data, datar, exact, checks, flags, slots=None):
    """Target slots of layer 1 hold the reference K/V; everything else is still NaN."""
    slots = case[-1] if slots is None else slots
    H_kv, D = data.shape[-2:]
    written = torch.zeros(data.shape[2] * data.shape[3], dtype=torch.bool)
    written[slots.cpu()] = True
    for which, label in ((0, "k"), (1, "v")):
        flat = data[1, which].reshape(-1, H_kv, D)
        flat_r = datar[1, which].reshape(-1, H_kv, D)
        checks.update({f"{label}_{k}": v for k, v in compare(flat[slots], flat_r[slots], exact or label == "v").items()})
        flags[f"{label}_untouched"] = bool(torch.isnan(flat[~written.to(flat.device)]).all())
    flags["layer0_untouched"] = bool(torch.isnan(data[0]).all())


def _worker_main():
    assert fz.triton_interpreting(), "worker must import triton with TRITON_INTERPRET=1"
    torch.manual_seed(0)
    report_cases(list(INTERP_CASES) + EXTRA_CASES, _interp_case)


@pytest.fixture(scope="module")
def interp_results():
    if not fz.HAS_TRITON:
        pytest.skip("triton not installed")
    return run_worker(__file__)


@pytest.mark.parametrize("name", list(INTERP_CASES) + EXTRA_CASES)
def test_kernel_matches_reference_interpreter(interp_results, name):
    assert_case(interp_results[name], need_any=True)


# --------------------------------------------------------------------------------------
# References vs the model code (CPU, no triton needed)
# --------------------------------------------------------------------------------------


def _shape(H, H_kv, D, qk_norm, dim=None):
    from shoal.model.config import TransformerShape

    return TransformerShape(dim=dim or H * D // 2, n_layer=1, n_head=H, n_local_heads=H_kv, head_dim=D,
                            intermediate_size=96, qk_norm=qk_norm)


def _randomize(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.dim() == 1 else p.shape[-1] ** -0.5)
                    + (1.0 if p.dim() == 1 else 0.0))
    return module


class _Capture:
    """AttentionBackend that records q/k/v and returns q (stands in for attend)."""

    def attend(self, layer, q, k, v):
        self.q, self.k, self.v = q, k, v
        return q


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 320, 2560])
def test_add_rmsnorm_ref_is_model_rmsnorm(dtype, dim):
    g = torch.Generator().manual_seed(dim)
    norm = _randomize(RMSNorm(dim, 1e-6), dim).to(dtype)
    x, r = rand((3, 2, dim), dtype, g, 2.0), rand((3, 2, dim), dtype, g, 2.0)
    o, h = fz.add_rmsnorm_ref(x, r, norm.weight, 1e-6)
    with torch.no_grad():
        assert torch.equal(h, x + r)
        assert torch.equal(o, norm(x + r))
        o2, h2 = fz.add_rmsnorm_ref(x, None, norm.weight, 1e-6)
        assert h2 is x and torch.equal(o2, norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("H,H_kv,D", [(4, 2, 32), (4, 4, 64), (8, 2, 128)])
def test_qk_norm_rope_write_ref_is_attention_forward(dtype, qk_norm, H, H_kv, D):
    shape = _shape(H, H_kv, D, qk_norm)
    attn = _randomize(Attention(shape, 1e-6), H * D + qk_norm).to(dtype)
    g = torch.Generator().manual_seed(D)
    B, S = 2, 3
    x = rand((B, S, shape.dim), dtype, g)
    positions = torch.randint(0, 2048, (B, S), generator=g)
    table = rope_table(2048, D, 1e6)
    cap = _Capture()
    with torch.no_grad():
        attn(x, table[positions], cap, 0)
        qkv = attn.wqkv(x)
    num_blocks, bs = 4, 4
    k_cache = torch.full((num_blocks, bs, H_kv, D), float("nan"), dtype=dtype)
    v_cache = k_cache.clone()
    slots = torch.randperm(num_blocks * bs, generator=g)[: B * S]
    q = fz.qk_norm_rope_write_ref(qkv, positions.reshape(-1), table,
                                  attn.q_norm.weight if qk_norm else None, attn.k_norm.weight if qk_norm else None,
                                  1e-6, k_cache, v_cache, slots, H, H_kv, D)
    assert torch.equal(q, cap.q.reshape(B * S, H, D))
    assert torch.equal(k_cache.view(-1, H_kv, D)[slots], cap.k.reshape(B * S, H_kv, D))
    assert torch.equal(v_cache.view(-1, H_kv, D)[slots], cap.v.reshape(B * S, H_kv, D))
    # The write is PagedKVCache.write.
    from shoal.engine.attention import PagedKVCache

    cache = PagedKVCache(1, num_blocks, bs, H_kv, D, dtype, torch.device("cpu"))
    cache.data.fill_(float("nan"))
    cache.write(0, slots, cap.k.reshape(B * S, H_kv, D), cap.v.reshape(B * S, H_kv, D))
    assert torch.equal(cache.k(0).nan_to_num(7.0), k_cache.nan_to_num(7.0))
    assert torch.equal(cache.v(0).nan_to_num(7.0), v_cache.nan_to_num(7.0))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_norm_matches_nn_rmsnorm_single_rounding(dtype):
    """nn.RMSNorm (F.rms_norm) rounds once after the weight multiply (torch's fused path);
    the kernel mirrors that, so pin it here: a torch change would show up."""
    g = torch.Generator().manual_seed(1)
    x = rand((256, 128), dtype, g, 3.0)
    w = rand((128,), dtype, g, 0.3) + 1
    xf = x.float()
    single = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6) * w.float()).to(dtype)
    assert torch.equal(F.rms_norm(x, (128,), w, 1e-6), single)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_ref_is_feed_forward(dtype):
    shape = _shape(4, 2, 32, False, dim=64)
    ff = _randomize(FeedForward(shape), 3).to(dtype)
    x = rand((2, 3, 64), dtype, torch.Generator().manual_seed(0))
    with torch.no_grad():
        gate_up = torch.cat([ff.w1(x), ff.w3(x)], dim=-1)
        assert torch.equal(ff.w2(fz.silu_mul_ref(gate_up)), ff(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_decomposition(dtype):
    """Block.forward == add_rmsnorm / attention / add_rmsnorm / silu_mul sequence."""
    shape = _shape(4, 2, 32, True, dim=64)
    block = _randomize(Block(shape, 1e-6), 5).to(dtype)
    g = torch.Generator().manual_seed(2)
    x = rand((2, 1, 64), dtype, g)
    cs = rope_table(64, 32, 1e6)[torch.tensor([[7], [40]])]
    with torch.no_grad():
        expect = block(x, cs, _Capture(), 0)
        n1, h0 = fz.add_rmsnorm_ref(x, None, block.attention_norm.weight, 1e-6)
        y = block.attention(n1, cs, _Capture(), 0)
        n2, h = fz.add_rmsnorm_ref(y, h0, block.ffn_norm.weight, 1e-6)
        ff = block.feed_forward
        out = ff.w2(fz.silu_mul_ref(torch.cat([ff.w1(n2), ff.w3(n2)], dim=-1)))
    assert torch.equal(out + h, expect)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H,H_kv", [(4, 2), (4, 4)])
def test_fast_attention_ref_is_fast_cache_backend(dtype, H, H_kv):
    from shoal.engine.attention import FastCacheBackend

    D, B, rows, C = 32, 3, 5, 10
    be = FastCacheBackend(2, rows, C, H, H_kv, D, dtype, torch.device("cpu"))
    g = torch.Generator().manual_seed(4)
    for p in range(C):
        be.position = p
        q = rand((B, 1, H, D), dtype, g)
        k, v = rand((B, 1, H_kv, D), dtype, g), rand((B, 1, H_kv, D), dtype, g)
        out = be.attend(1, q, k, v)
        r = fz.fast_decode_attention_ref(q[:, 0], be.k[1], be.v[1], p + 1)
        assert torch.equal(r, out[:, 0])


def test_cpu_fallback_is_reference():
    if fz.triton_interpreting():
        pytest.skip("triton imported in interpreter mode in this process")
    g = torch.Generator().manual_seed(0)
    x, r = rand((3, 64), torch.bfloat16, g), rand((3, 64), torch.bfloat16, g)
    w = rand((64,), torch.bfloat16, g) + 1
    o, h = fz.add_rmsnorm(x, r, w, 1e-6)
    ro, rh = fz.add_rmsnorm_ref(x, r, w, 1e-6)
    assert torch.equal(o, ro) and torch.equal(h, rh)
    out, h_out = torch.empty_like(x), torch.empty_like(x)
    o, h = fz.add_rmsnorm(x, r, w, 1e-6, out=out, h_out=h_out)
    assert o is out and h is h_out and torch.equal(o, ro) and torch.equal(h, rh)
    gu = rand((2, 128), torch.bfloat16, g)
    assert torch.equal(fz.silu_mul(gu), fz.silu_mul_ref(gu))
    case = qk_case(3, 4, 2, 32, torch.bfloat16, True)
    q, data = run_qk(fz.qk_norm_rope_write, case, 4, 2, 32)
    qr, datar = run_qk(fz.qk_norm_rope_write_ref, case, 4, 2, 32)
    assert torch.equal(q, qr) and torch.equal(data.nan_to_num(7.0), datar.nan_to_num(7.0))
    qa = rand((2, 4, 32), torch.float32, g)
    kc, vc = rand((3, 10, 2, 32), torch.float32, g), rand((3, 10, 2, 32), torch.float32, g)
    assert torch.equal(fz.fast_decode_attention(qa, kc, vc, 4), fz.fast_decode_attention_ref(qa, kc, vc, 4))


def test_cpu_fast_rope_attention_quant_out_is_quantize_act():
    """The reference path fills ``quant_out`` with quantize_act of its output; head_dim 64
    (two heads per 1x128 group) is refused."""
    from shoal.kernels import fp8

    if fz.triton_interpreting():
        pytest.skip("triton imported in interpreter mode in this process")
    g = torch.Generator().manual_seed(1)
    B, H, H_kv, D, C = 2, 6, 2, 128, 8  # a group of 3 query heads per KV head
    qkv = rand((B, (H + 2 * H_kv) * D), torch.bfloat16, g, 2.0)
    table = rand((C, D // 2, 2), torch.bfloat16, g)
    kv = rand((2, B, C, H_kv, D), torch.bfloat16, g)
    q8 = torch.zeros(B, H * D, dtype=torch.float8_e4m3fn)
    s8 = torch.zeros(B, H)
    o = fz.fast_rope_attention(qkv, table, kv[0], kv[1], 5, H, H_kv, D, quant_out=(q8, s8))
    rq, rs = fp8.quantize_act_ref(o.reshape(B, H * D))
    assert torch.equal(q8.view(torch.uint8), rq.view(torch.uint8)) and torch.equal(s8, rs)
    with pytest.raises(ValueError, match="head_dim 128"):
        fz.fast_rope_attention(qkv[:, : (H + 2 * H_kv) * 64], table[:, :32], kv[0][..., :64], kv[1][..., :64],
                               5, H, H_kv, 64, quant_out=(q8, s8))


def test_input_validation():
    if not fz.HAS_TRITON:
        pytest.skip("triton not installed")
    x = torch.zeros(2, 64)
    if not fz.triton_interpreting():
        with pytest.raises(RuntimeError):
            fz.add_rmsnorm_triton(x, None, torch.ones(64), 1e-6)  # compiled kernel on CPU
    with pytest.raises(ValueError):
        fz.qk_norm_rope_write_ref(torch.zeros(2, 100), torch.zeros(2, dtype=torch.long), rope_table(8, 32, 1e4),
                                  None, None, 1e-6, torch.zeros(4, 2, 32), torch.zeros(4, 2, 32),
                                  torch.zeros(2, dtype=torch.long), 4, 2, 32)
    with pytest.raises(ValueError):
        fz.qk_norm_rope_write_ref(torch.zeros(2, 256), torch.zeros(2, dtype=torch.long), rope_table(8, 32, 1e4),
                                  torch.ones(32), None, 1e-6, torch.zeros(4, 2, 32), torch.zeros(4, 2, 32),
                                  torch.zeros(2, dtype=torch.long), 4, 2, 32)


# --------------------------------------------------------------------------------------
# GPU tests (compiled kernels, S2-Pro shapes)
# --------------------------------------------------------------------------------------

gpu = pytest.mark.skipif(
    not (torch.cuda.is_available() and fz.HAS_TRITON and not fz.triton_interpreting()),
    reason="needs CUDA and Triton in compiled mode",
)
S2_DIM, S2_H, S2_KV, S2_D, S2_INTER = 2560, 32, 8, 128, 9728


def _assert_checks(checks, what):
    for k, (value, limit) in checks.items():
        assert value <= limit, (what, k, value, limit)


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("N", [1, 16, 64, 128])
def test_gpu_add_rmsnorm(N, dtype):
    dt = _DTYPES[dtype]
    g = torch.Generator().manual_seed(N)
    x, r = rand((N, S2_DIM), dt, g, 2.0, "cuda"), rand((N, S2_DIM), dt, g, 2.0, "cuda")
    w = rand((S2_DIM,), dt, g, 0.2, "cuda") + 1
    for res in (r, None):
        o, h = fz.add_rmsnorm(x, res, w, 1e-6)
        ro, rh = fz.add_rmsnorm_ref(x, res, w, 1e-6)
        assert torch.equal(h, rh)
        _assert_checks(compare(o, ro, False), "normed")


@gpu
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("N", [1, 16, 64, 128])
def test_gpu_qk_norm_rope_write(N, dtype, norm):
    dt = _DTYPES[dtype]
    case = qk_case(N, S2_H, S2_KV, S2_D, dt, norm, seed=N, device="cuda", num_blocks=64, block_size=16,
                   table_len=32768)
    q, data = run_qk(fz.qk_norm_rope_write, case, S2_H, S2_KV, S2_D)
    qr, datar = run_qk(fz.qk_norm_rope_write_ref, case, S2_H, S2_KV, S2_D)
    checks, flags = dict(compare(q, qr, not norm)), {}
    _check_caches(case, data, datar, not norm, checks, flags)
    _assert_checks(checks, "qk")
    assert all(flags.values()), flags


@gpu
@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("N", [64, 1000])
def test_gpu_qk_norm_rope_write_rows_form_same_bits(N, fp8):  # (64 rows: the helper lowers the threshold)
    """At S2-Pro shapes the rows form (prefill) writes exactly what one token per program
    writes: q, K / V (bf16 cache, or e4m3 token-minor values with their scales)."""
    from shoal.kernels.paged_attention_fp8 import token_minor_like

    g = torch.Generator().manual_seed(N)
    nb, bs = 40, 64
    qkv = rand((N, (S2_H + 2 * S2_KV) * S2_D), torch.bfloat16, g, 3.0, "cuda")
    pos = torch.randint(0, 4096, (N,), generator=g).cuda()
    tab = rope_table(4096, S2_D, 1e6).to(torch.bfloat16).cuda()
    qw = rand((S2_D,), torch.bfloat16, g, 0.3, "cuda") + 1
    kw = rand((S2_D,), torch.bfloat16, g, 0.3, "cuda") + 1
    slots = torch.randperm(nb * bs, generator=g)[:N].cuda()
    slots[N // 3] = -1

    def run():
        if fp8:
            kc = torch.zeros(nb, bs, S2_KV, S2_D, dtype=torch.float8_e4m3fn, device="cuda")
            vc = token_minor_like(kc.shape, "cuda")
            ks, vs = torch.zeros(nb, bs, S2_KV, device="cuda"), torch.zeros(nb, bs, S2_KV, device="cuda")
            q = fz.qk_norm_rope_write(qkv, pos, tab, qw, kw, 1e-6, kc, vc, slots, S2_H, S2_KV, S2_D,
                                      k_scale=ks, v_scale=vs)
            return q, kc.view(torch.uint8), vc.contiguous().view(torch.uint8), ks, vs
        kc = torch.zeros(nb, bs, S2_KV, S2_D, dtype=torch.bfloat16, device="cuda")
        vc = torch.zeros_like(kc)
        q = fz.qk_norm_rope_write(qkv, pos, tab, qw, kw, 1e-6, kc.view(-1, S2_KV, S2_D), vc.view(-1, S2_KV, S2_D),
                                  slots, S2_H, S2_KV, S2_D)
        return q, kc, vc

    outs, names = _qk_both_forms(run)
    assert names == ["_qk_norm_rope_write_rows_kernel", "_qk_norm_rope_write_kernel"], names
    for a, b in zip(*outs):
        assert torch.equal(a, b)


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("N", [1, 16, 64, 128])
def test_gpu_silu_mul(N, dtype):
    dt = _DTYPES[dtype]
    gu = rand((N, 2 * S2_INTER), dt, torch.Generator().manual_seed(N), 3.0, "cuda")
    o, r = fz.silu_mul(gu), fz.silu_mul_ref(gu)
    if dt == torch.bfloat16:  # exact if libdevice expf == CUDA expf; else <= 1 ulp, rare
        u = ulp_diff(o, r)
        assert u.max().item() <= 1 and (u > 0).float().mean().item() <= 1e-3
    else:
        _assert_checks(compare(o, r, True), "silu")


@gpu
@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("B", [1, 16, 64])
def test_gpu_fast_attention(B, dtype):
    dt = _DTYPES[dtype]
    g = torch.Generator().manual_seed(B)
    q = rand((B, S2_H, S2_D), dt, g, 2.0, "cuda")
    kv = rand((4, 2, B + 3, 10, S2_KV, S2_D), dt, g, 1.0, "cuda")
    for length in range(1, 11):
        o = fz.fast_decode_attention(q, kv[2, 0], kv[2, 1], length)
        # fp32 math on the CPU (no TF32 / SDPA backend choice involved)
        r = fz.fast_decode_attention_ref(q.float().cpu(), kv[2, 0].float().cpu(), kv[2, 1].float().cpu(), length)
        if dt == torch.float32:
            torch.testing.assert_close(o.cpu(), r, atol=1e-5, rtol=1e-5)
        else:  # the fp32 result rounded once; GPU exp2 vs CPU exp moves the fp32 value by a few
            # fp32 ulps, which flips a bf16 rounding now and then (by more than one bf16 ulp only
            # where the output is a cancellation-small sum)
            u = ulp_diff(o.cpu(), r.to(dt))
            assert (u > 1).float().mean().item() <= 1e-3, u.max()
            assert (o.cpu().float() - r).abs().max().item() <= 2.0 ** -8 * r.abs().max().item()


@gpu
def test_gpu_cuda_graph_capture_and_replay():
    dt, N = torch.bfloat16, 8
    g = torch.Generator().manual_seed(0)
    x, r = rand((N, S2_DIM), dt, g, 2.0, "cuda"), rand((N, S2_DIM), dt, g, 2.0, "cuda")
    w = rand((S2_DIM,), dt, g, 0.2, "cuda") + 1
    case = qk_case(N, S2_H, S2_KV, S2_D, dt, True, device="cuda", num_blocks=32, block_size=16)
    qkv, pos, table, qw, kw, _, kc, vc, slots = case
    gu = rand((N, 2 * S2_INTER), dt, g, 3.0, "cuda")
    fk = rand((N, 10, S2_KV, S2_D), dt, g, 1.0, "cuda")
    fv = rand((N, 10, S2_KV, S2_D), dt, g, 1.0, "cuda")
    normed, h, q, act = torch.empty_like(x), torch.empty_like(x), torch.empty(N, S2_H, S2_D, dtype=dt, device="cuda"), \
        torch.empty(N, S2_INTER, dtype=dt, device="cuda")
    fo = torch.empty(N, S2_H, S2_D, dtype=dt, device="cuda")

    def step():
        fz.add_rmsnorm(x, r, w, 1e-6, out=normed, h_out=h)
        fz.qk_norm_rope_write(qkv, pos, table, qw, kw, 1e-6, kc, vc, slots, S2_H, S2_KV, S2_D, q_out=q)
        fz.silu_mul(gu, out=act)
        fz.fast_decode_attention(q, fk, fv, 6, out=fo)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for it in range(3):
        for t in (x, r, qkv, gu, fk, fv):
            t.copy_(torch.randn(t.shape, device="cuda").to(dt))
        pos.copy_(torch.randint(0, 4096, pos.shape, device="cuda"))
        slots.copy_(torch.randperm(32 * 16, device="cuda")[:N])
        graph.replay()
        ro, rh = fz.add_rmsnorm_ref(x, r, w, 1e-6)
        assert torch.equal(h, rh), it
        _assert_checks(compare(normed, ro, False), "normed")
        kc2, vc2 = kc.clone(), vc.clone()
        qr = fz.qk_norm_rope_write_ref(qkv, pos, table, qw, kw, 1e-6, kc2, vc2, slots, S2_H, S2_KV, S2_D)
        _assert_checks(compare(q, qr, False), "q")
        assert torch.equal(vc.view(-1, S2_KV, S2_D)[slots], vc2.view(-1, S2_KV, S2_D)[slots])
        _assert_checks(compare(kc.view(-1, S2_KV, S2_D)[slots], kc2.view(-1, S2_KV, S2_D)[slots], False), "k")
        assert ulp_diff(act, fz.silu_mul_ref(gu)).max().item() <= 1
        torch.testing.assert_close(fo.float(), fz.fast_decode_attention_ref(q, fk, fv, 6).float(), atol=2e-2, rtol=2e-2)


if __name__ == "__main__":
    _worker_main()
