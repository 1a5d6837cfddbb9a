"""The modded-DAC codec: causal conv encoder, downsampling RVQ, causal conv decoder.

Structure and parameter names follow fish-speech ``modded_dac.DAC`` +
``rvq.DownsampleResidualVectorQuantize`` (weight norm folded).  See
``docs/codec.md``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from .config import CodecConfig, QuantizerConfig
from ..kernels.codec_conv import conv1d_cl_triton
from ..kernels.codec_unit import residual_unit_triton, unit_supported
from ..kernels.fused import use_triton
from ..kernels.snake import snake as snake_op
from .layers import (
    CausalConv1d,
    CausalConvTranspose1d,
    ConvNeXtBlock,
    FeedForward,
    ResidualUnit,
    Seq,
    Snake,
    StreamingModule,
    StreamState,
    WindowLimitedTransformer,
    assign_state_keys,
    rewrite_in_own_storage,
)

__all__ = ["Encoder", "Decoder", "VectorQuantize", "ResidualVectorQuantize", "DownsampleRVQ", "Codec"]


class EncoderBlock(StreamingModule):
    def __init__(self, dim: int, stride: int, transformer):
        super().__init__()
        self.block = Seq(
            ResidualUnit(dim // 2, 1),
            ResidualUnit(dim // 2, 3),
            ResidualUnit(dim // 2, 9),
            Snake(dim // 2),
            CausalConv1d(dim // 2, dim, 2 * stride, stride=stride),
            WindowLimitedTransformer(transformer) if transformer is not None else nn.Identity(),
        )

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        return self.block(x, state)


class Encoder(StreamingModule):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        d = cfg.encoder_dim
        blocks: list[nn.Module] = [CausalConv1d(1, d, 7)]
        for i, stride in enumerate(cfg.encoder_rates):
            d *= 2
            blocks.append(EncoderBlock(d, stride, cfg.encoder_block_transformer(i)))
        blocks += [Snake(d), CausalConv1d(d, cfg.latent_dim, 3)]
        self.block = Seq(*blocks)

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        return self.block(x, state)


class DecoderBlock(StreamingModule):
    def __init__(self, in_dim: int, out_dim: int, stride: int):
        super().__init__()
        self.block = Seq(
            Snake(in_dim),
            CausalConvTranspose1d(in_dim, out_dim, 2 * stride, stride=stride),
            ResidualUnit(out_dim, 1),
            ResidualUnit(out_dim, 3),
            ResidualUnit(out_dim, 9),
        )

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        return self.block(x, state)


class Decoder(StreamingModule):
    def __init__(self, cfg: CodecConfig):
        super().__init__()
        layers: list[nn.Module] = [CausalConv1d(cfg.latent_dim, cfg.decoder_dim, 7)]
        out_dim = cfg.decoder_dim
        for (in_dim, out_dim), stride in zip(cfg.decoder_block_channels, cfg.decoder_rates):
            layers.append(DecoderBlock(in_dim, out_dim, stride))
        layers += [Snake(out_dim), CausalConv1d(out_dim, 1, 7), nn.Tanh()]
        self.model = Seq(*layers)
        self.fused = True  # Codec.configure_serving(fused=False): the module-by-module path
        self.channels_last = False
        # Triton convs: Snakes in the conv epilogues (_forward_triton) rather than separate
        # kernels: False (none), "all", "k1" (only the k=1 convs' residual + Snake epilogues;
        # the dilated k=7 convs write their output and the separate Snake kernel follows), or
        # "fused" (as "k1", but each k=1 conv applies the k=7 output's Snake to its input tiles
        # as it loads them, and each block's transposed-conv GEMM adds its bias and the first
        # Snake in its epilogue: no separate Snake kernels inside the blocks, no Snake'd copies
        # written; the Snake before the first block stays a kernel), or "unit" (as "fused", each
        # residual unit of at most 192 channels one kernel where verified, see
        # shoal.kernels.codec_unit.unit_supported; the rest as "k1")
        self.snake_epilogue: bool | str = False
        # with any Snake epilogue mode: each block's bias + first Snake in its transposed-conv
        # GEMM's epilogue, as "fused" does (configure_serving(tconv_snake=True)), so the
        # bias-free GEMM output is never stored and no Snake pass reads it back
        self.tconv_snake = False
        # row groups (Codec.configure_serving(group_positions=N)): the blocks after the first
        # run over groups of streams holding at most N decoder-input positions (streams x 4 x
        # frames) at a time, so a call's activation peak -- and the memory a CUDA graph of it
        # keeps -- is that of an N-position call, whatever the batch. None: one group.
        self.group_positions: int | None = None
        # how many decoder blocks run over the whole call before the row groups start
        # (configure_serving(group_head_blocks=N)); 0: every block runs in the groups
        self.group_head_blocks = 1

    def forward(self, x: Tensor, state: StreamState | None = None) -> Tensor:
        if self.fused:
            if self.triton_conv and self.snake_epilogue and use_triton(x):
                return self._forward_triton(x, state)
            return self._forward_fused(x, state)
        return self.model(x, state)

    def row_groups(self, batch: int, positions: int) -> list[tuple[int, int]]:
        """Row ranges ``[(r0, r1), ...]`` a call of ``batch`` streams x ``positions`` input
        positions runs its high-rate blocks in (one range when it fits ``group_positions``)."""
        n = self.group_positions
        if not n or batch <= 1 or batch * positions <= n:
            return [(0, batch)]
        per = max(1, n // max(1, positions))
        return [(r, min(batch, r + per)) for r in range(0, batch, per)]

    @staticmethod
    def _rows(state: StreamState | None, r0: int, r1: int) -> StreamState | None:
        return None if state is None else state.select(slice(r0, r1))  # views: writes land in place

    def _grouped(self, x: Tensor, state: StreamState | None, head, tail) -> Tensor:
        """``tail(head(x, state), state)`` with ``tail`` run per row group on row views of the
        carry and of ``state``, each group's audio written into one output."""
        carry = head(x, state)
        groups = self.row_groups(x.shape[0], x.shape[-1])
        if len(groups) == 1:
            return tail(carry, state)
        out = None
        for r0, r1 in groups:
            part = tail(tuple(None if c is None else c[r0:r1] for c in carry), self._rows(state, r0, r1))
            if out is None:
                out = part.new_empty((x.shape[0],) + tuple(part.shape[1:]))
            out[r0:r1] = part
        return out

    @property
    def triton_conv(self) -> bool:
        return bool(self.model[0].triton_conv)

    def _act(self, x: Tensor, shape: tuple[int, int, int] | None = None) -> Tensor:
        """Uninitialized tensor shaped like x (or ``shape``, on x's device and dtype) in the
        decoder's activation layout."""
        B, C, L = shape or x.shape
        if self.channels_last:
            return torch.empty(B, L, C, device=x.device, dtype=x.dtype).transpose(1, 2)
        return torch.empty(B, C, L, device=x.device, dtype=x.dtype)

    def _forward_triton(self, x: Tensor, state: StreamState | None) -> Tensor:
        """``_forward_fused`` with every convolution a Triton implicit GEMM (channels-last) and
        each Snake computed in the epilogue of the conv before it:

        * a transposed conv is a 2-tap GEMM over [previous input sample | new input];
        * a unit's k7 conv writes ``Snake(conv)`` (the input of its k1 conv) and nothing else;
        * a unit's k1 conv adds the residual and writes the new residual stream ``h`` (when a
          unit follows) and ``Snake(h)`` straight into the next conv's input buffer after its
          carried left context.

        Each activation is written once and read once per conv; rounding is that of the
        separate kernels (see docs/codec.md).
        """
        m = self.model
        if x.shape[1] > 1:
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        blocks = list(m[1:-3])
        split = min(self.group_head_blocks, len(blocks))

        def head(x, state):
            h = m[0](x, state)
            first_ct = blocks[0].block[1]
            buf = first_ct.input_buffer(h, h.shape[-1])
            first_ct.fill_context(buf, state)
            snake_op(h, blocks[0].block[0].alpha, out=buf[..., 1:])
            return (self._triton_blocks(blocks, 0, split, buf, state),)

        def tail(carry, state):
            buf = self._triton_blocks(blocks, split, len(blocks), carry[0], state)
            final_conv = m[-2]
            final_conv._save_context(buf, state)
            return torch.tanh(final_conv._conv(buf))

        return self._grouped(x, state, head, tail)

    def _triton_blocks(self, blocks: list, start: int, stop: int, buf: Tensor, state: StreamState | None) -> Tensor:
        """Blocks ``start:stop`` of :meth:`_forward_triton`: ``buf`` is block ``start``'s
        transposed-conv input (context + Snake'd samples); returns the next conv's input
        buffer (the next block's, or the final conv's)."""
        for bi in range(start, stop):
            blk = blocks[bi]
            ct, units = blk.block[1], [u.block for u in list(blk.block)[2:]]
            # each activation is dropped right after its last use (``del``): the live set, and
            # so the CUDA-graph pool that records it, is what the next kernel needs, not every
            # tensor a local name still holds
            ct.save_context(buf, state)
            c7 = units[0][1]
            fused = self.snake_epilogue == "fused"
            if fused or self.tconv_snake:  # bias and Snake in the GEMM's epilogue
                n = (buf.shape[-1] - 1) * ct.stride
                h = self._act(buf, (buf.shape[0], ct.conv.out_channels, n))
                cbuf = c7._buffer(h, c7.padding + n)
                c7._with_context(cbuf, state)
                ct.gemm_forward_snake(buf, units[0][0].alpha, h, cbuf[..., c7.padding:])
                del buf
            else:
                y = ct.gemm_forward(buf)
                del buf
                cbuf = c7._buffer(y, c7.padding + y.shape[-1])
                c7._with_context(cbuf, state)
                h = self._act(y)
                snake_op(y, units[0][0].alpha, None, ct.conv.bias, out=cbuf[..., c7.padding:], h_out=h)
                del y
            # "unit": each residual unit of at most MAX_UNIT_CHANNELS channels is one kernel
            one_kernel = self.snake_epilogue == "unit" and unit_supported(h.shape[1])
            for j, (_, conv7, snake2, conv1) in enumerate(units):
                conv7._save_context(cbuf, state)
                if one_kernel:
                    nbuf, body, h_new, alpha = self._unit_next(blocks, units, bi, j, h, state)
                    residual_unit_triton(cbuf, conv7.packed_weight(), conv7.conv.bias, conv7.dilation,
                                         snake2.alpha, conv1.packed_weight(), conv1.conv.bias, h,
                                         out=h_new, snake_alpha=alpha, snake_out=body,
                                         write_out=h_new is not None)
                    del cbuf, body
                    h, cbuf = h_new, nbuf
                    del h_new, nbuf
                    continue
                # the k7 conv's input (its context saved above) is dropped as soon as the conv
                # has read it, before anything else is allocated
                pre_alpha = None
                if fused:  # the k1 conv Snakes its input tiles itself
                    s2 = conv1d_cl_triton(cbuf, conv7.packed_weight(), conv7.conv.bias, conv7.dilation)
                    del cbuf
                    pre_alpha = snake2.alpha
                elif self.snake_epilogue in ("k1", "unit"):  # a k7 tile's Snake epilogue costs more than the kernel
                    s2 = conv1d_cl_triton(cbuf, conv7.packed_weight(), conv7.conv.bias, conv7.dilation)
                    del cbuf
                    snake_op(s2, snake2.alpha, out=s2)  # in place: elementwise
                else:
                    s2 = self._act(h)
                    conv1d_cl_triton(cbuf, conv7.packed_weight(), conv7.conv.bias, conv7.dilation,
                                     snake_alpha=snake2.alpha, snake_out=s2, write_out=False)
                    del cbuf
                nbuf, body, h_new, alpha = self._unit_next(blocks, units, bi, j, h, state)
                conv1d_cl_triton(s2, conv1.packed_weight(), conv1.conv.bias, 1, residual=h, out=h_new,
                                 snake_alpha=alpha, snake_out=body, write_out=h_new is not None,
                                 pre_snake_alpha=pre_alpha)
                del s2, body
                h, cbuf = h_new, nbuf
                del h_new, nbuf
            buf = cbuf
            del cbuf, h
        return buf

    def _unit_next(self, blocks: list, units: list, bi: int, j: int, h: Tensor,
                   state: StreamState | None) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
        """Where unit ``j`` of block ``bi`` writes: ``(next conv's input buffer with its
        context filled, the view its Snake'd samples go to, the new residual stream h' (``h``
        itself, updated in place) or None when no unit follows in this block, that Snake's
        alpha)``."""
        if j + 1 < len(units):
            nxt, alpha = units[j + 1][1], units[j + 1][0].alpha
            nbuf = nxt._buffer(h, nxt.padding + h.shape[-1])
            nxt._with_context(nbuf, state)
            # the new residual stream overwrites h in place: the unit's kernel reads h only as
            # the residual, each sample just before it stores that sample's sum (h is this
            # block's own activation, read by nothing after the unit), so one activation fewer
            # is live across the unit -- and kept by the CUDA-graph pool that records it
            return nbuf, nbuf[..., nxt.padding:], h, alpha
        if bi + 1 < len(blocks):
            nxt, alpha = blocks[bi + 1].block[1], blocks[bi + 1].block[0].alpha
            nbuf = nxt.input_buffer(h, h.shape[-1])
            nxt.fill_context(nbuf, state)
            return nbuf, nbuf[..., 1:], None, alpha
        nxt, alpha = self.model[-2], self.model[-3].alpha
        nbuf = nxt._buffer(h, nxt.padding + h.shape[-1])
        nxt._with_context(nbuf, state)
        return nbuf, nbuf[..., nxt.padding:], None, alpha

    def _forward_fused(self, x: Tensor, state: StreamState | None) -> Tensor:
        """The same computation as ``self.model`` with fewer passes over the activations.

        The residual add of each unit is fused with the Snake that follows it (the next
        unit's, the next block's, or the final one); each Snake writes straight into the
        input buffer of its conv after the carried left context; the transposed conv's bias
        is added inside the Snake that follows it. One-shot is the streaming path with zero
        context. See docs/codec.md.
        """
        m = self.model
        if self.channels_last and x.shape[1] > 1:
            x = x.transpose(1, 2).contiguous().transpose(1, 2)
        blocks = list(m[1:-3])
        split = min(self.group_head_blocks, len(blocks))

        def head(x, state):
            # pending: branch output still to be added to the residual stream h
            return self._fused_blocks(blocks[:split], m[0](x, state), None, state)

        def tail(carry, state):
            h, pending = self._fused_blocks(blocks[split:], carry[0], carry[1], state)
            out, _ = m[-2].snake_conv(h, m[-3].alpha, state, y=pending)
            return torch.tanh(out)

        return self._grouped(x, state, head, tail)

    def _fused_blocks(self, blocks: list, h: Tensor, pending: Tensor | None,
                      state: StreamState | None) -> tuple[Tensor, Tensor | None]:
        """``blocks`` of :meth:`_forward_fused` on the residual stream ``h`` (+ ``pending``)."""
        for blk in blocks:
            sn, ct, units = blk.block[0], blk.block[1], list(blk.block)[2:]
            s, _ = snake_op(h, sn.alpha, pending)
            y = ct.forward_nobias(s, state)
            for j, u in enumerate(units):
                snake1, conv7, snake2, conv1 = u.block
                h_new = self._act(y)
                if j == 0:
                    a, h = conv7.snake_conv(y, snake1.alpha, state, bias=ct.conv.bias, h_out=h_new)
                else:
                    a, h = conv7.snake_conv(h, snake1.alpha, state, y=pending, h_out=h_new)
                s2, _ = snake_op(a, snake2.alpha)
                pending = conv1(s2)
        return h, pending


class VectorQuantize(nn.Module):
    """Factorized, L2-normalized VQ (dac ``VectorQuantize``); projections are k=1 convs."""

    def __init__(self, input_dim: int, codebook_size: int, codebook_dim: int):
        super().__init__()
        self.codebook_size = codebook_size
        self.in_proj = nn.Conv1d(input_dim, codebook_dim, 1)
        self.out_proj = nn.Conv1d(codebook_dim, input_dim, 1)
        self.codebook = nn.Embedding(codebook_size, codebook_dim)

    def encode(self, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """z [B, D, T] → (out_proj of the quantized latent [B, D, T], codes [B, T], z_e [B, d, T])."""
        z_e = self.in_proj(z)
        B, d, T = z_e.shape
        enc = F.normalize(z_e.transpose(1, 2).reshape(B * T, d).float())
        cb = F.normalize(self.codebook.weight.float())
        dist = enc.pow(2).sum(1, keepdim=True) - 2 * enc @ cb.t() + cb.pow(2).sum(1, keepdim=True).t()
        codes = (-dist).max(1)[1].view(B, T)
        z_q = self.embed(codes)
        z_q = z_e + (z_q - z_e)  # the reference's straight-through form (not bit-equal to z_q)
        return self.out_proj(z_q), codes, z_e

    def embed(self, codes: Tensor) -> Tensor:
        """codes [B, T] → un-normalized codebook rows [B, d, T]."""
        return F.embedding(codes, self.codebook.weight).transpose(1, 2)

    def decode(self, codes: Tensor) -> Tensor:
        return self.out_proj(self.embed(codes))


class ResidualVectorQuantize(nn.Module):
    def __init__(self, input_dim: int, n_codebooks: int, codebook_size: int, codebook_dim: int):
        super().__init__()
        self.codebook_size = codebook_size
        self.quantizers = nn.ModuleList(
            VectorQuantize(input_dim, codebook_size, codebook_dim) for _ in range(n_codebooks)
        )

    def encode(self, z: Tensor) -> tuple[Tensor, Tensor, list[Tensor]]:
        """Quantize the running residual → (Σ stage outputs, codes [B, N, T], [z_e per stage])."""
        z_q: Tensor | float = 0.0
        residual = z
        codes, latents = [], []
        for q in self.quantizers:
            z_q_i, c, z_e = q.encode(residual)
            z_q = z_q + z_q_i
            residual = residual - z_q_i
            codes.append(c)
            latents.append(z_e)
        return z_q, torch.stack(codes, dim=1), latents  # type: ignore[return-value]

    def decode(self, codes: Tensor) -> Tensor:
        z_q: Tensor | float = 0.0
        for i, q in enumerate(self.quantizers):
            z_q = z_q + q.decode(codes[:, i])
        return z_q  # type: ignore[return-value]


class DownsampleRVQ(nn.Module):
    """``DownsampleResidualVectorQuantize`` (eval mode, no quantizer dropout)."""

    def __init__(self, cfg: QuantizerConfig):
        super().__init__()
        self.cfg = cfg
        dims = cfg.all_dims
        # Registration order matches the reference state-dict order.
        self.semantic_quantizer = ResidualVectorQuantize(cfg.input_dim, 1, cfg.semantic_codebook_size, cfg.codebook_dim)
        self.quantizer = ResidualVectorQuantize(cfg.input_dim, cfg.n_codebooks, cfg.codebook_size, cfg.codebook_dim)

        def convnext(d: int) -> ConvNeXtBlock:
            return ConvNeXtBlock(d, cfg.convnext_mlp_ratio, cfg.convnext_kernel_size, cfg.convnext_layernorm_eps)

        self.downsample = Seq(
            *[
                Seq(CausalConv1d(dims[i], dims[i + 1], f, stride=f, weight_norm=False), convnext(dims[i + 1]))
                for i, f in enumerate(cfg.downsample_factor)
            ]
        )
        self.upsample = Seq(
            *[
                Seq(CausalConvTranspose1d(dims[i + 1], dims[i], f, stride=f, weight_norm=False), convnext(dims[i]))
                for i, f in reversed(list(enumerate(cfg.downsample_factor)))
            ]
        )
        self.pre_module = WindowLimitedTransformer(cfg.pre_module)
        self.post_module = WindowLimitedTransformer(cfg.post_module)

    @property
    def codebook_maxes(self) -> tuple[int, int]:
        return self.cfg.semantic_codebook_size - 1, self.cfg.codebook_size - 1

    def encode(self, z: Tensor, return_intermediates: bool = False):
        """Latent [B, D, 4T] → codes [B, 1+N, T] (int64)."""
        x = self.downsample(z)
        pre = self.pre_module(x)
        sem_z, sem_codes, sem_lat = self.semantic_quantizer.encode(pre)
        _, res_codes, res_lat = self.quantizer.encode(pre - sem_z)
        codes = torch.cat([sem_codes, res_codes], dim=1)
        if return_intermediates:
            return codes, {"downsample_out": x, "pre_module_out": pre, "z_e": sem_lat + res_lat}
        return codes

    def clamp_codes(self, codes: Tensor) -> Tensor:
        """New tensor with code0 in [0, 4095] and codes 1.. in [0, 1023] (the input is not touched)."""
        smax, rmax = self.codebook_maxes
        codes = codes.long()
        return torch.cat([codes[:, :1].clamp(0, smax), codes[:, 1:].clamp(0, rmax)], dim=1)

    def codes_to_latent(self, codes: Tensor) -> Tensor:
        """Clamped codes [B, 1+N, T] → z_q [B, D, T] = Σ out_proj(codebook[code])."""
        return self.semantic_quantizer.decode(codes[:, :1]) + self.quantizer.decode(codes[:, 1:])

    def decode(self, codes: Tensor, state: StreamState | None = None, rope: Tensor | None = None) -> Tensor:
        z = self.codes_to_latent(self.clamp_codes(codes))
        # the codebooks belong to the encode side; a codec whose decode side runs in another
        # precision (Codec.set_decode_dtype) rounds the summed latent once, here
        z = z.to(self.post_module.norm.weight.dtype)
        z = self.post_module(z, state, rope) if state is not None else self.post_module(z)
        return self.upsample(z, state)


def _normal_device(device: str | torch.device) -> torch.device:
    """``device`` with a CUDA index filled in (``cuda`` -> ``cuda:<current>``), for comparing."""
    d = torch.device(device)
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return d


class Codec(nn.Module):
    """The modded-DAC codec (44.1 kHz mono, hop 2048, 10 codebooks).

    Build with :func:`shoal.codec.load_codec`; a bare ``Codec(cfg)`` has
    arbitrary weights.
    """

    def __init__(self, config: CodecConfig):
        super().__init__()
        self.config = config
        self.sample_rate = config.sample_rate
        self.frame_length = config.frame_length
        self.hop_length = config.hop_length_encoder
        self.num_codebooks = config.num_codebooks
        self.codebook_sizes = config.codebook_sizes
        self.encoder = Encoder(config)
        self.quantizer = DownsampleRVQ(config.quantizer)
        self.decoder = Decoder(config)
        # the serving options a caller set through configure_serving (window_state,
        # transformer_kernels, tconv_snake); ``streaming.apply_serving_defaults`` leaves these
        # alone and records neither its defaults nor the environment's choices here
        self.serving_set: set[str] = set()
        assign_state_keys(self)

    @property
    def device(self) -> torch.device:
        return self.decoder.model[0].conv.weight.device

    @property
    def dtype(self) -> torch.dtype:
        """The decode side's precision (audio out, streaming state): see :meth:`set_decode_dtype`."""
        return self.decoder.model[0].conv.weight.dtype

    @property
    def encode_dtype(self) -> torch.dtype:
        """The encode side's precision (audio in, encoder, quantizer codebooks)."""
        return self.encoder.block[0].conv.weight.dtype

    def decode_modules(self) -> tuple[nn.Module, ...]:
        """The modules only decode runs: ``quantizer.post_module``, ``quantizer.upsample`` and
        ``decoder``. The codebooks and their projections are shared with encode (the code ->
        latent lookup) and stay on the encode side."""
        return self.quantizer.post_module, self.quantizer.upsample, self.decoder

    def encode_modules(self) -> tuple[nn.Module, ...]:
        """Everything else: the encoder, the quantizer's downsample and pre_module, and the
        semantic and residual VQ codebooks and projections (decode uses those too)."""
        q = self.quantizer
        return self.encoder, q.semantic_quantizer, q.quantizer, q.downsample, q.pre_module

    def place(self, device: str | torch.device, dtype: torch.dtype,
              decode_dtype: torch.dtype | None = None) -> "Codec":
        """Move to ``device`` in ``dtype``, the decode-only modules in ``decode_dtype`` when
        given (each side cast once from the current weights); returns ``self``."""
        device, src = _normal_device(device), _normal_device(self.device)
        if decode_dtype is None or decode_dtype == dtype:
            sides = ((self, dtype),)
        else:
            sides = tuple((m, dtype) for m in self.encode_modules()) + \
                tuple((m, decode_dtype) for m in self.decode_modules())
        for m, dt in sides:
            if src != device:
                # cast where the weights are, then move: a cross-device copy that also casts
                # stages every tensor in the source dtype on the target device, and those
                # freed staging blocks stay reserved between the live weights (measured:
                # ~0.5 GiB of an H200's memory for the real codec's decode side)
                m.to(dtype=dt)
                # the transformers' w1 | w3 move as one buffer, the form the fused streaming
                # path's single GEMM reads (FeedForward.place_w13): stacking them on the device
                # later would leave their first copies' blocks reserved
                for ff in [x for x in m.modules() if isinstance(x, FeedForward)]:
                    ff.place_w13(device, dt)
            m.to(device=device, dtype=dt)
        return self

    def set_decode_dtype(self, dtype: torch.dtype) -> "Codec":
        """Cast the decode-only modules (:meth:`decode_modules`) to ``dtype``, in place; the
        encode side keeps its precision. ``decode`` then looks codes up in the encode-side
        codebooks and rounds the summed latent to ``dtype`` once, before ``post_module``
        (e.g. bf16 decode for serving speed, fp32 encode for exact reference codes)."""
        for m in self.decode_modules():
            m.to(dtype=dtype)
        return self

    def _prepare_audio(self, audio: Tensor) -> Tensor:
        if audio.dim() == 1:
            audio = audio[None, None]
        elif audio.dim() == 2:
            audio = audio[:, None]
        if audio.dim() != 3 or audio.shape[1] != 1:
            raise ValueError(f"audio must be [B, 1, N] (mono), got shape {tuple(audio.shape)}")
        audio = audio.to(device=self.device, dtype=self.encode_dtype)
        n = audio.shape[-1]
        right = -n % self.frame_length
        return F.pad(audio, (0, right)) if right else audio

    @torch.no_grad()
    def encode(self, audio: Tensor, lengths: Tensor | None = None, return_intermediates: bool = False):
        """audio [B, 1, N] at 44.1 kHz → (codes [B, 10, ceil(N/2048)] int64, code_lengths [B] int64).

        Items shorter than N are zero-padded on the right by the caller; their
        codes past ``code_lengths`` are padding.  Causality makes a padded
        item's valid codes identical to encoding it alone.
        """
        x = self._prepare_audio(audio)
        if x.shape[-1] == 0:
            raise ValueError("cannot encode empty audio")
        B = x.shape[0]
        T = x.shape[-1] // self.frame_length
        z = self.encoder(x)
        out = self.quantizer.encode(z, return_intermediates=return_intermediates)
        codes = out[0] if return_intermediates else out
        if lengths is None:
            code_lengths = torch.full((B,), T, dtype=torch.long, device=codes.device)
        else:
            lengths = torch.as_tensor(lengths, device=codes.device).long()
            code_lengths = (lengths + self.frame_length - 1) // self.frame_length
        if return_intermediates:
            inter = dict(out[1])
            inter["encoder_out"] = z
            return codes, code_lengths, inter
        return codes, code_lengths

    def _check_codes(self, codes: Tensor) -> Tensor:
        if codes.dim() == 2:
            codes = codes[None]
        if codes.dim() != 3 or codes.shape[1] != self.num_codebooks:
            raise ValueError(f"codes must be [B, {self.num_codebooks}, T], got shape {tuple(codes.shape)}")
        if codes.is_floating_point():
            raise ValueError("codes must be an integer tensor")
        return codes.to(self.device)

    @torch.no_grad()
    def decode(self, codes: Tensor) -> Tensor:
        """codes [B, 10, T] → waveform [B, 1, 2048·T] in [-1, 1].

        Codes are clamped (code0 ≤ 4095, codes 1..9 ≤ 1023, all ≥ 0) on a copy;
        the caller's tensor is never modified (the reference clamps in place).
        """
        codes = self._check_codes(codes)
        if codes.shape[-1] == 0:
            return torch.zeros(codes.shape[0], 1, 0, device=self.device, dtype=self.dtype)
        return self.decoder(self.quantizer.decode(codes))

    def decode_latent(self, codes: Tensor, state: StreamState | None = None, rope: Tensor | None = None) -> Tensor:
        """Codes → decoder input [B, D, 4T] (post_module + upsample); used by streaming."""
        return self.quantizer.decode(self._check_codes(codes), state, rope)

    def configure_serving(self, *, fused: bool | None = None, channels_last: bool | None = None,
                          triton_conv: bool | None = None, snake_epilogue: bool | str | None = None,
                          group_positions: int | None | bool = False,
                          window_state: str | None = None, group_head_blocks: int | None = None,
                          transformer_kernels: bool | None = None,
                          tconv_snake: bool | None = None) -> "Codec":
        """Decode-path execution options (numerically equivalent; chosen by measurement).

        ``fused`` (default on): the decoder's fused Snake / residual path (``Decoder._forward_fused``);
        off runs the module-by-module reference structure. ``channels_last``: decoder
        convolutions run as channels-last conv2d over activations stored [B, L, C] (cuDNN
        often prefers NHWC for tensor cores); needs ``fused``. ``triton_conv``: the decoder's
        stride-1 convolutions run as the Triton implicit-GEMM kernel of
        :mod:`shoal.kernels.codec_conv` (CUDA or the Triton interpreter; needs ``channels_last``),
        and the transposed convs as 2-tap GEMMs. ``snake_epilogue`` (with ``triton_conv``): each
        Snake computed in the epilogue of the conv before it instead of by the separate fused
        Snake kernel (``Decoder._forward_triton``; same numbers); ``"k1"``: only the k=1 convs'
        (residual add, new residual stream and the next Snake in one epilogue), the k=7 convs'
        Snakes stay separate kernels; ``"fused"``: ``"k1"`` with each k=7 conv's Snake applied by
        the k=1 conv to its input tiles and each block's bias + first Snake in the transposed
        conv's GEMM epilogue (no separate Snake kernels inside the blocks); ``"unit"``: ``"k1"``
        with each residual unit that ``shoal.kernels.codec_unit.unit_supported`` accepts one
        kernel (the k=7 conv's output stays on chip). ``group_positions``: the decoder's blocks after the first
        run over groups of streams of at most this many input positions (streams x 4 x frames;
        ``None``: no groups; left unchanged when not given): the same numbers, a bounded
        activation peak (see ``Decoder.row_groups``); ``group_head_blocks``: how many decoder
        blocks run over the whole call before the groups start (1 until set; 0 groups every
        block, which bounds the first block's activations too). ``window_state``: what a stream carries
        of the codec transformer's attention window (``WindowLimitedTransformer``): ``"kv"``
        its keys and values, ``"hidden"`` each layer's normed inputs (half the bytes; keys and
        values recomputed per call), ``"ring"`` the keys and values in ring order (attended and
        updated in place by a kernel); set it before any stream state is made.
        ``transformer_kernels``: the codec transformer's streaming calls run their norms,
        LayerScale residual adds, RoPE and SwiGLU as fused Triton kernels (CUDA or the
        interpreter; ``WindowLimitedTransformer._forward_stream_kernels``), w1 and w3 as one GEMM.
        ``tconv_snake`` (with ``triton_conv`` and a Snake epilogue mode): each block's transposed
        conv adds its bias and computes the first unit's Snake in its GEMM epilogue (what
        ``"fused"`` does there), writing the residual stream and the Snake'd conv input directly;
        the same bits as the separate Snake kernel.
        """
        if tconv_snake is not None:
            self.decoder.tconv_snake = bool(tconv_snake)
        if transformer_kernels is not None:
            tr = self.quantizer.post_module
            tr.kernels = bool(transformer_kernels)
            if tr.kernels:  # w1|w3 stacked now, not inside a first call a CUDA graph may capture
                for layer in tr.layers:
                    layer.feed_forward.stacked_w13()
        if group_head_blocks is not None:
            if int(group_head_blocks) < 0:
                raise ValueError(f"group_head_blocks must be >= 0, got {group_head_blocks!r}")
            self.decoder.group_head_blocks = int(group_head_blocks)
        if window_state is not None:
            from .layers import WindowLimitedTransformer

            ws = str(window_state).strip().lower()
            if ws not in WindowLimitedTransformer.WINDOW_STATES:
                raise ValueError(f"window_state must be one of {WindowLimitedTransformer.WINDOW_STATES}, "
                                 f"got {window_state!r}")
            self.quantizer.post_module.window_state = ws
        # recorded once validated (a refused value leaves the option to the defaults)
        self.serving_set.update(name for name, value in (("window_state", window_state),
                                                         ("transformer_kernels", transformer_kernels),
                                                         ("tconv_snake", tconv_snake)) if value is not None)
        if group_positions is not False:
            if group_positions is not None and int(group_positions) < 1:
                raise ValueError(f"group_positions must be >= 1 or None, got {group_positions!r}")
            self.decoder.group_positions = None if group_positions is None else int(group_positions)
        if snake_epilogue is not None:
            if isinstance(snake_epilogue, str):
                key = snake_epilogue.strip().lower()
                if key not in ("k1", "fused", "unit", "all", "none"):
                    raise ValueError("snake_epilogue must be a bool, 'all', 'k1', 'fused', 'unit' or 'none', "
                                     f"got {snake_epilogue!r}")
                self.decoder.snake_epilogue = {"all": True, "none": False}.get(key, key)
            else:
                self.decoder.snake_epilogue = bool(snake_epilogue)
        if fused is not None:
            self.decoder.fused = bool(fused)
        if channels_last is not None:
            self.decoder.channels_last = bool(channels_last)
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            for mod in self.decoder.modules():
                if isinstance(mod, (CausalConv1d, CausalConvTranspose1d)):
                    mod.channels_last = bool(channels_last)
                    if getattr(mod, "shares_packed_weight", False):
                        if triton_conv is None or triton_conv:
                            # the weight is held in the packed form the Triton conv reads: keep it
                            # there (a copy would move the packed weight under captured graphs)
                            continue
                        mod.unshare_packed_weight()  # the Triton conv goes off: cuDNN's own layout
                    # weights stored channels-last once (no per-call conversion inside cuDNN)
                    w = mod.conv.weight
                    w.data = rewrite_in_own_storage(w, w.detach().unsqueeze(2).contiguous(memory_format=fmt).squeeze(2))
        if triton_conv is not None:
            for mod in self.decoder.modules():
                if isinstance(mod, (CausalConv1d, CausalConvTranspose1d)):
                    mod.triton_conv = bool(triton_conv)
                    if not triton_conv:
                        if getattr(mod, "shares_packed_weight", False):
                            mod.unshare_packed_weight()  # cuDNN reads conv.weight: its own layout again
                        mod._packed = None  # nothing reads the packed copy any more
        if self.decoder.channels_last and not self.decoder.fused:
            raise ValueError("channels_last needs the fused decoder path")
        if any(getattr(m, "triton_conv", False) for m in self.decoder.modules()) and not self.decoder.channels_last:
            raise ValueError("triton_conv needs channels_last")
        return self

    @torch.no_grad()
    def encode_batch(self, clips: list[Tensor], max_batch: int = 16, max_batch_samples: int = 44100 * 600) -> list[Tensor]:
        """Encode variable-length mono clips (each [N] or [1, N] or [1, 1, N]) → codes [10, ceil(N/2048)] each.

        Clips are sorted by length and right-padded into batches of at most ``max_batch``
        clips and ``max_batch_samples`` padded samples; causality makes every clip's codes
        those of encoding it alone. Order of the result = order of ``clips``.
        """
        flat = []
        for c in clips:
            c = torch.as_tensor(c)
            if c.dim() > 1:
                if c.numel() != c.shape[-1]:
                    raise ValueError(f"clips must be mono, got shape {tuple(c.shape)}")
                c = c.reshape(-1)
            if c.numel() == 0:
                raise ValueError("cannot encode empty audio")
            flat.append(c)
        order = sorted(range(len(flat)), key=lambda i: -flat[i].numel())
        out: list[Tensor | None] = [None] * len(flat)
        i = 0
        while i < len(order):
            longest = flat[order[i]].numel()
            longest += -longest % self.frame_length
            n = max(1, min(max_batch, max_batch_samples // max(longest, 1)))
            group = order[i: i + n]
            batch = torch.zeros(len(group), 1, longest, dtype=self.encode_dtype, device=self.device)
            lengths = []
            for r, j in enumerate(group):
                batch[r, 0, : flat[j].numel()] = flat[j].to(device=self.device, dtype=self.encode_dtype)
                lengths.append(flat[j].numel())
            codes, code_lengths = self.encode(batch, torch.tensor(lengths))
            for r, j in enumerate(group):
                out[j] = codes[r, :, : int(code_lengths[r])]
            i += n
        return out  # type: ignore[return-value]
