"""Which weights a forward reads: a test helper for the "skips the unused work" tests."""

from __future__ import annotations

from shoal.model import dualar


def record_weight_reads(monkeypatch, modules) -> tuple[list, list]:
    """Record every weight a projection reads, on either model path: the fused path's GEMM
    helpers (``dualar._linear``, ``dualar.dense_swiglu``, patched through ``monkeypatch``) and
    forward hooks on ``modules`` (the plain path's module calls). Returns ``(used, hooks)``;
    remove the hooks when done."""
    used = []
    real_linear, real_swiglu = dualar._linear, dualar.dense_swiglu
    monkeypatch.setattr(dualar, "_linear", lambda mod, a: (used.append(mod.weight), real_linear(mod, a))[1])
    monkeypatch.setattr(dualar, "dense_swiglu", lambda a, w13: (used.append(w13), real_swiglu(a, w13))[1])
    hooks = [m.register_forward_hook(lambda m, *a: used.append(m.weight)) for m in modules]
    return used, hooks
