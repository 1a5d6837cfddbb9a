"""The DualAR model: a slow transformer over the token grid and a fast transformer over the
10 codebooks of one frame. Every forward is batched and takes per-sequence positions.

Numerics follow fish-speech spec §2: the codebook-embedding sum divided by sqrt(C+1) at
semantic positions (text embedding included), a final-normed fast input for S2 (pre-norm for
S1), tied or untied slow head.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .config import ModelConfig
from .layers import AttentionBackend, Block, RMSNorm, rope_table
from .static_cache import StaticKVCache


def _linear(mod: nn.Module, x: Tensor) -> Tensor:
    """A projection of the fused path: a plain bf16 ``nn.Linear`` goes through
    :func:`~shoal.kernels.dense.dense_linear` (the decode GEMM where it beats cuBLAS), any
    other module (FP8Linear) through its own forward."""
    if type(mod) is nn.Linear:
        return dense_linear(x, mod.weight, mod.bias)
    return mod(x)


def dense_linear(x: Tensor, w: Tensor, bias: Tensor | None = None) -> Tensor:
    """:func:`shoal.kernels.dense.dense_linear`, imported on first use (importing the model
    does not import Triton)."""
    from ..kernels.dense import dense_linear as impl

    return impl(x, w, bias)


def dense_swiglu(x: Tensor, w13: Tensor) -> Tensor:
    """:func:`shoal.kernels.dense.dense_swiglu` (``silu_mul(dense_linear(x, w13))``, fused into
    one kernel with ``SHOAL_DENSE_SWIGLU=1``), imported on first use."""
    from ..kernels.dense import dense_swiglu as impl

    return impl(x, w13)


@dataclass
class SlowOutput:
    logits: Tensor | None  # [B, vocab] ("full") or [B, A] ("allowed") at each row's last position
    fast_input: Tensor  # [B, dim]: hidden state that seeds the fast transformer
    hidden: Tensor  # [B, S, dim]: pre-norm residual stream (for tests / debugging)


class DualAR(nn.Module):
    # FP8 weights + fused kernels: run the fused FP8 layer (kernels/fp8_fused.py: split-K
    # partials and activation quantization consumed by the next kernel, bit-identical);
    # False runs the unfused FP8 kernels (comparisons, benchmarks)
    fp8_fusion: bool = True
    # slow KV cache dtype of the reference loop (new_slow_cache): None = the model's dtype,
    # torch.float8_e4m3fn = the engine's FP8 KV cache (shoal.quant.kv; the correctness gate)
    kv_cache_dtype: torch.dtype | None = None

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        if config.semantic_begin_id is None or config.semantic_end_id is None:
            raise ValueError("ModelConfig needs semantic_begin_id / semantic_end_id")
        self.config = config
        s, f = config.slow, config.fast
        self.embeddings = nn.Embedding(config.vocab_size, s.dim)
        self.codebook_embeddings = nn.Embedding(config.num_codebooks * config.codebook_size, s.dim)
        self.layers = nn.ModuleList(Block(s, config.norm_eps) for _ in range(s.n_layer))
        self.norm = RMSNorm(s.dim, config.norm_eps)
        if not config.tie_word_embeddings:
            self.output = nn.Linear(s.dim, config.vocab_size, bias=False)
        self.fast_embeddings = nn.Embedding(config.codebook_size, f.dim)
        self.fast_layers = nn.ModuleList(Block(f, config.norm_eps) for _ in range(f.n_layer))
        self.fast_norm = RMSNorm(f.dim, config.norm_eps)
        self.fast_output = nn.Linear(f.dim, config.codebook_size, bias=False)
        self.init_buffers()

    def init_buffers(self, device: torch.device | str | None = None) -> None:
        """(Re)build the non-persistent tables; call after loading weights onto a device."""
        c = self.config
        device = device if device is not None else self.embeddings.weight.device
        self.register_buffer("slow_rope", rope_table(c.max_seq_len, c.slow.head_dim, c.rope_base)
                             .to(device), persistent=False)
        self.register_buffer("fast_rope", rope_table(c.num_codebooks, c.fast.head_dim, c.rope_base)
                             .to(device), persistent=False)
        self.register_buffer("codebook_offsets",
                             (torch.arange(c.num_codebooks) * c.codebook_size).to(device),
                             persistent=False)

    # ----------------------------------------------------------------- helpers
    @property
    def dtype(self) -> torch.dtype:
        return self.embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embeddings.weight.device

    def new_slow_cache(self, batch: int, max_len: int | None = None) -> StaticKVCache:
        """The reference loop's slow cache; its dtype follows ``self.kv_cache_dtype`` (None: the
        model's; ``torch.float8_e4m3fn``: the FP8 KV cache the engine serves with)."""
        s = self.config.slow
        return StaticKVCache(s.n_layer, batch, max_len or self.config.max_seq_len, s.n_local_heads,
                             s.head_dim, s.n_head, self.dtype, self.device,
                             kv_dtype=self.kv_cache_dtype)

    def new_fast_cache(self, batch: int) -> StaticKVCache:
        f = self.config.fast
        return StaticKVCache(f.n_layer, batch, self.config.num_codebooks, f.n_local_heads,
                             f.head_dim, f.n_head, self.dtype, self.device)

    def is_semantic(self, tokens: Tensor) -> Tensor:
        c = self.config
        return (tokens >= c.semantic_begin_id) & (tokens <= c.semantic_end_id)

    # ----------------------------------------------------------------- slow
    def embed(self, grid: Tensor) -> Tensor:
        """grid [B, 1+C, S] -> input embeddings [B, S, dim]."""
        c = self.config
        tokens = grid[:, 0]
        codes = grid[:, 1:] + self.codebook_offsets[None, :, None]
        vq = self.codebook_embeddings(codes).sum(dim=1)  # [B, S, dim]
        semantic = self.is_semantic(tokens).unsqueeze(-1)
        vq = vq.masked_fill(~semantic, 0)
        x = self.embeddings(tokens) + vq
        if c.scale_codebook_embeddings:
            x = torch.where(semantic, x / math.sqrt(c.num_codebooks + 1), x)
        return x

    def slow_head(self, normed: Tensor) -> Tensor:
        if self.config.tie_word_embeddings:
            return nn.functional.linear(normed, self.embeddings.weight)
        return self.output(normed)

    def set_allowed_tokens(self, extra_ids: list[int]) -> None:
        """Precompute the head rows of the tokens the main token may take: the semantic ids, then
        ``extra_ids`` (``<|im_end|>``). Logits over these A rows equal the full logits masked to
        them, at a fraction of the head's cost (S2: 4,097 of 155,776 rows)."""
        c = self.config
        ids = torch.cat([torch.arange(c.semantic_begin_id, c.semantic_end_id + 1),
                         torch.tensor(extra_ids, dtype=torch.long)]).to(self.device)
        weight = self.embeddings.weight if c.tie_word_embeddings else self.output.weight
        self.register_buffer("allowed_ids", ids, persistent=False)
        self.register_buffer("allowed_head", weight[ids].contiguous(), persistent=False)

    def allowed_logits(self, normed: Tensor) -> Tensor:
        if not hasattr(self, "allowed_head"):
            raise RuntimeError("call set_allowed_tokens() first")
        return dense_linear(normed, self.allowed_head)

    # ----------------------------------------------------------------- fused path
    def enable_fused_kernels(self, enabled: bool = True) -> None:
        """Use the fused Triton kernels (add+RMSNorm, qk-norm+RoPE+KV write, SiLU*mul) with
        backends that support it (the engine's decode and fast caches). Concatenates w1|w3 into
        one GEMM per MLP; w1/w3 become views into it (no extra memory)."""
        self.fused = enabled
        if not enabled:
            return
        for stack in (self.layers, self.fast_layers):
            stack.__dict__.pop("_fp8_fused_ok", None)  # fp8_fused.stack_supported's cache
        for layer in list(self.layers) + list(self.fast_layers):
            ff = layer.feed_forward
            if hasattr(ff.w1, "weight_q"):  # FP8Linear (shoal.quant): one stacked FP8 GEMM
                if getattr(ff, "w13_fp8", None) is None:
                    w13 = type(ff.w1).concat([ff.w1, ff.w3])
                    inter = ff.w1.out_features
                    ff.w1.weight_q, ff.w3.weight_q = w13.weight_q[:inter], w13.weight_q[inter:]
                    nb = ff.w1.weight_scale.shape[0]
                    ff.w1.weight_scale, ff.w3.weight_scale = w13.weight_scale[:nb], w13.weight_scale[nb:]
                    ff.w13_fp8 = w13
                continue
            if getattr(ff, "w13", None) is None:
                inter = ff.w1.weight.shape[0]
                w13 = torch.cat([ff.w1.weight, ff.w3.weight], dim=0)
                ff.w13 = w13
                ff.w1.weight = nn.Parameter(w13[:inter], requires_grad=False)
                ff.w3.weight = nn.Parameter(w13[inter:], requires_grad=False)

    def _layers_fused(self, x: Tensor, layers: nn.ModuleList, positions: Tensor, rope: Tensor,
                      backend, *, final_norm: Tensor | None = None,
                      kv_only_last: bool = False) -> Tensor | tuple[Tensor, Tensor] | None:
        """Run ``layers`` with fused kernels and return the last hidden state [B, S, D].
        Numerically the same sequence as Block.forward (same roundings).

        ``final_norm`` (a norm weight): the last residual add runs fused with that RMSNorm and
        (normed [B*S, D], hidden [B, S, D]) is returned. ``kv_only_last``: the last layer only
        writes its K/V (the positions' outputs are not read) and None is returned."""
        from ..kernels import fp8_fused
        from ..kernels.fp8 import silu_mul_quant
        from ..kernels.fused import add_rmsnorm, fast_rope_attention_enabled, qk_norm_rope_write, silu_mul

        eps = self.config.norm_eps
        B, S, D = x.shape
        # SHOAL_FAST_ROPE_ATTN: a backend with one kernel for RoPE + K/V write + attention
        rope_attend = getattr(backend, "rope_attend", None) if fast_rope_attention_enabled() else None
        N = B * S
        pos = positions.reshape(N)
        h = x.reshape(N, D)
        # FP8 (Triton): norms write the next GEMM's quantized input, GEMMs leave split-K partials
        # to the kernel that reads them (fp8_fused); bit-identical to the unfused FP8 kernels
        fp8 = self.fp8_fusion and fp8_fused.active(layers, h)
        if fp8:
            h, act = fp8_fused.norm_quant(h, None, layers[0].attention_norm.weight, eps)
        else:
            normed, h = add_rmsnorm(h, None, layers[0].attention_norm.weight, eps)
        for i, layer in enumerate(layers):
            att = layer.attention
            sh = att.shape
            qkv = fp8_fused.project(att.wqkv, act) if fp8 else _linear(att.wqkv, normed)
            y_act = None  # wo's FP8 input, when the attention kernel wrote it
            if (rope_attend is not None and not sh.qk_norm and isinstance(qkv, Tensor)
                    and not (kv_only_last and i + 1 == len(layers))):
                # RoPE, the K/V write and the attention as one kernel (fast positions)
                if fp8 and sh.head_dim == 128 and fp8_fused.attn_quant():
                    y, y_act = rope_attend(i, qkv, rope, sh.n_head, sh.n_local_heads, sh.head_dim, quant=True)
                else:
                    y = rope_attend(i, qkv, rope, sh.n_head, sh.n_local_heads, sh.head_dim)
            else:
                k_cache, v_cache, slots = backend.fused_target(i)
                k_scale, v_scale = backend.kv_scales(i) if hasattr(backend, "kv_scales") else (None, None)
                q = qk_norm_rope_write(qkv, pos, rope,
                                       att.q_norm.weight if sh.qk_norm else None,
                                       att.k_norm.weight if sh.qk_norm else None, eps,
                                       k_cache, v_cache, slots, sh.n_head, sh.n_local_heads, sh.head_dim,
                                       k_scale=k_scale, v_scale=v_scale)
                if kv_only_last and i + 1 == len(layers):
                    return None  # K/V written; attention, wo and the MLP would feed nothing
                y = backend.attend_only(i, q.view(B, S, sh.n_head, sh.head_dim))
            ff = layer.feed_forward
            if fp8:
                a = fp8_fused.project(att.wo, y_act if y_act is not None else y.reshape(N, sh.q_size))
                h, act = fp8_fused.norm_quant(a, h, layer.ffn_norm.weight, eps)
                f = fp8_fused.mlp(ff, act, partials=i + 1 < len(layers))  # last layer: bf16 for h + f
            else:
                a = _linear(att.wo, y.reshape(N, sh.q_size))
                normed, h = add_rmsnorm(a, h, layer.ffn_norm.weight, eps)
                w13_fp8 = getattr(ff, "w13_fp8", None)
                if w13_fp8 is not None and w13_fp8.use_kernels(normed):
                    gu = w13_fp8.forward_kernels(normed)
                    f = ff.w2.forward_kernels(gu, quantized=silu_mul_quant(gu))
                elif w13_fp8 is not None:
                    f = ff.w2(silu_mul(w13_fp8(normed)))
                else:
                    f = _linear(ff.w2, dense_swiglu(normed, ff.w13))
            if i + 1 < len(layers):
                if fp8:
                    h, act = fp8_fused.norm_quant(f, h, layers[i + 1].attention_norm.weight, eps)
                else:
                    normed, h = add_rmsnorm(f, h, layers[i + 1].attention_norm.weight, eps)
            elif final_norm is not None:
                normed, h = add_rmsnorm(f, h, final_norm, eps)
                return normed, h.view(B, S, D)
            else:
                h = h + f
        return h.view(B, S, D)

    def _final_norm(self, x: Tensor, norm: nn.Module, fused: bool) -> Tensor:
        """RMSNorm of the last hidden state: one fused kernel on the fused path (same numerics)."""
        if not fused:
            return norm(x)
        from ..kernels.fused import add_rmsnorm

        return add_rmsnorm(x, None, norm.weight, self.config.norm_eps)[0]

    def _use_fused(self, backend) -> bool:
        return getattr(self, "fused", False) and hasattr(backend, "fused_target")

    def forward_slow(self, grid: Tensor, positions: Tensor, backend: AttentionBackend,
                     last_index: Tensor | None = None, head: str | None = "full") -> SlowOutput:
        """grid [B, 1+C, S], positions [B, S]; the backend must already be bound to positions.

        ``last_index`` [B] selects the position (within S) whose logits are returned; default S-1.
        ``head``: "full" (whole vocabulary), "allowed" (see :meth:`set_allowed_tokens`) or None.
        """
        x = self.embed(grid)
        normed = None
        if self._use_fused(backend):
            if grid.shape[-1] == 1:  # decode: the last residual add fused with the final norm
                normed, x = self._layers_fused(x, self.layers, positions, self.slow_rope, backend,
                                               final_norm=self.norm.weight)
            else:
                x = self._layers_fused(x, self.layers, positions, self.slow_rope, backend)
        else:
            cos_sin = self.slow_rope[positions]
            for i, layer in enumerate(self.layers):
                x = layer(x, cos_sin, backend, i)
        B, S, _ = x.shape
        if last_index is None:
            last = x[:, -1]
        else:
            last = x[torch.arange(B, device=x.device), last_index]
        if normed is None:
            normed = self._final_norm(last, self.norm, self._use_fused(backend))
        if head == "full":
            logits = self.slow_head(normed)
        elif head == "allowed":
            logits = self.allowed_logits(normed)
        else:
            logits = None
        fast_in = normed if self.config.norm_fastlayer_input else last
        return SlowOutput(logits=logits, fast_input=fast_in, hidden=x)

    def prefill_kv(self, grid: Tensor, positions: Tensor, backend: AttentionBackend) -> None:
        """Write every slow layer's K/V for the columns of ``grid`` and nothing else: a prompt
        chunk whose outputs nobody reads (the last prompt column is the first decode input). The
        last layer stops after its K/V write (no attention, ``wo``, MLP or final norm), which
        leaves the cache exactly as :meth:`forward_slow` leaves it. ``backend`` must also have
        ``write_kv(layer, k, v)`` on the plain (unfused) path."""
        x = self.embed(grid)
        if self._use_fused(backend):
            self._layers_fused(x, self.layers, positions, self.slow_rope, backend, kv_only_last=True)
            return
        cos_sin = self.slow_rope[positions]
        last = len(self.layers) - 1
        for i, layer in enumerate(self.layers):
            if i == last:
                layer.write_kv(x, cos_sin, backend, i)
            else:
                x = layer(x, cos_sin, backend, i)

    # ----------------------------------------------------------------- fast
    def forward_fast(self, x: Tensor, position: int, backend: AttentionBackend,
                     n_out: int | None = None) -> Tensor | None:
        """x [B, dim] at codebook position ``position`` (0 = the slow hidden state) -> logits
        [B, n_out] (the first ``n_out`` codes; default all; 0 skips the head and returns None).
        The backend must be bound to positions ``[[position]] * B``."""
        h = x.unsqueeze(1)
        fused = self._use_fused(backend)
        kv_only = n_out == 0  # nothing reads the last layer's output: it only writes its K/V
        if fused:
            table = getattr(backend, "fused_positions", None)
            pos = (table() if table is not None
                   else torch.full((h.shape[0], 1), position, dtype=torch.long, device=h.device))
            out = self._layers_fused(h, self.fast_layers, pos, self.fast_rope, backend,
                                     final_norm=None if kv_only else self.fast_norm.weight,
                                     kv_only_last=kv_only)
            if kv_only:
                return None
            normed = out[0]
        else:
            cos_sin = self.fast_rope[position].expand(h.shape[0], 1, *self.fast_rope.shape[1:])
            last = len(self.fast_layers) - 1
            for i, layer in enumerate(self.fast_layers):
                if kv_only and i == last:
                    layer.write_kv(h, cos_sin, backend, i)
                    return None
                h = layer(h, cos_sin, backend, i)
            normed = self._final_norm(h[:, 0], self.fast_norm, fused)
        head = self.fast_output
        if hasattr(head, "weight_q") and head.use_kernels(normed):  # FP8 head (shoal.quant)
            from ..kernels.fp8 import fp8_linear

            n = head.out_features if n_out is None else n_out
            if n % 128 == 0:  # a whole number of 128-row scale blocks: slice the weight
                return fp8_linear(normed, head.weight_q[:n], head.weight_scale[: n // 128]).to(head.dtype)
            return head(normed)[:, :n]
        w = head.weight if n_out is None else head.weight[:n_out]
        return dense_linear(normed, w)
