"""The plain reference generation loop for one request (fish-speech spec §5.1).

This is the yardstick the batched engine is tested against: one prefill, then one frame per
step (slow forward -> constrained main-token sample with RAS -> 10-position fast loop). It
uses the same batched model forwards and sampling functions as the engine.

Deviations from the reference are switched by :class:`Fidelity` (docs/fidelity.md);
``Fidelity.reference(family)`` reproduces the reference exactly for parity tests.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from ..model.dualar import DualAR
from .sampling import (BatchSampling, NoiseSource, SamplingParams, apply_repetition_penalty, race,
                       residual_code, s1_logits_to_probs, s1_main_token, s2_main_token, sample_s2)


class PromptTooLongError(ValueError):
    """The prompt leaves no room to generate within the model's context."""


@dataclass(frozen=True)
class Fidelity:
    """Where shoal deliberately departs from the reference (see docs/fidelity.md)."""

    drop_last_frame: bool = False  # reference drops the last frame even when stopped by length
    mask_residual_codes: bool = True  # reference (S2) samples residual codes over all 4096 ids
    noise_in_model_dtype: bool = False  # reference draws U in bf16 (U = 0 -> token 0 artefacts)
    s1_reference_penalty_window: bool = False  # S1: column-0 slow window + zero-padded windows
    s1_constrain_semantic: bool = True  # S1 reference samples the main token from the full vocab

    @classmethod
    def reference(cls, family: str) -> "Fidelity":
        return cls(drop_last_frame=True, mask_residual_codes=(family == "s1"),
                   noise_in_model_dtype=True, s1_reference_penalty_window=True,
                   s1_constrain_semantic=False)


@dataclass
class GenerationResult:
    codes: np.ndarray  # int64 [num_codebooks, frames]: the audio frames kept
    columns: Tensor  # int64 [1 + C, steps]: every generated column (incl. a final im_end one)
    stop_reason: str  # "eos" or "length"
    prompt_len: int
    prefill_s: float = 0.0
    decode_s: float = 0.0
    extra: dict = field(default_factory=dict)


def allowed_main_tokens(model: DualAR, im_end_id: int) -> Tensor:
    """[vocab] bool: the semantic ids and <|im_end|> (the S2 slow-logit constraint)."""
    c = model.config
    mask = torch.zeros(c.vocab_size, dtype=torch.bool, device=model.device)
    mask[c.semantic_begin_id: c.semantic_end_id + 1] = True
    mask[im_end_id] = True
    return mask


def make_noise(model: DualAR, seed: int, fidelity: Fidelity) -> NoiseSource:
    dtype = model.dtype if fidelity.noise_in_model_dtype else torch.float32
    return NoiseSource([seed], device=model.device, dtype=dtype,
                       exponential=(model.config.family == "s1"))


class _S1Windows:
    """S1 repetition-penalty windows over previously decoded columns."""

    def __init__(self, width: int, reference: bool) -> None:
        self.width = width
        self.reference = reference
        self.columns: list[Tensor] = []  # decoded frames (prefill frame excluded)

    def _window(self, C1: int, device: torch.device) -> Tensor:
        i = len(self.columns)
        if self.reference:  # zero-padded [C1, width] window; frames beyond i are zeros
            cols = self.columns[:self.width] if i < self.width else self.columns[i - self.width:i]
            w = torch.zeros(C1, self.width, dtype=torch.long, device=device)
            if cols:
                w[:, : len(cols)] = torch.stack(cols, dim=1)
            return w
        cols = self.columns[-self.width:]
        if not cols:
            return torch.full((C1, 0), -1, dtype=torch.long, device=device)
        return torch.stack(cols, dim=1)

    def slow_ids(self, C1: int, device: torch.device) -> Tensor:
        w = self._window(C1, device)
        return (w[:, 0] if self.reference else w[0])[None, :]

    def fast_ids(self, k: int, C1: int, device: torch.device) -> Tensor:
        return self._window(C1, device)[k + 1][None, :]


def _check_prompt(model: DualAR, grid: Tensor | np.ndarray, max_new_tokens: int) -> tuple[Tensor, int]:
    cfg = model.config
    C = cfg.num_codebooks
    grid = torch.as_tensor(np.asarray(grid), dtype=torch.long, device=model.device)
    if grid.dim() != 2 or grid.shape[0] != C + 1:
        raise ValueError(f"prompt grid must be [{C + 1}, T], got {list(grid.shape)}")
    T = grid.shape[1]
    if T >= cfg.max_seq_len:
        raise PromptTooLongError(
            f"prompt has {T} tokens but the model context is {cfg.max_seq_len}; "
            "use shorter references or text")
    budget = cfg.max_seq_len - T
    return grid, (budget if not max_new_tokens else min(max_new_tokens, budget))


def _uses_engine_sampler(fidelity: Fidelity) -> bool:
    return fidelity == Fidelity(drop_last_frame=fidelity.drop_last_frame)


def generate_frames(model: DualAR, grid: Tensor | np.ndarray, params: SamplingParams,
                    im_end_id: int, max_new_tokens: int = 0, *, seed: int = 0,
                    frame_offset: int = 0, noise: NoiseSource | None = None,
                    fidelity: Fidelity = Fidelity()) -> Iterator[Tensor]:
    """Yield generated columns ([1 + C] int64) one frame at a time, the im_end column last.

    With shoal's defaults the frame is sampled exactly as the batched engine samples it
    (allowed-token head, counter-based noise keyed on ``seed`` and the request's frame index
    ``frame_offset + step``), so a seeded request gives the same codes here and in the engine.
    Any reference quirk in ``fidelity`` switches to the reference sampler (per-request torch
    generator ``noise``, full-vocabulary logits).
    """
    params.validate()
    if _uses_engine_sampler(fidelity):
        yield from _frames_engine_sampler(model, grid, params, im_end_id, max_new_tokens, seed, frame_offset)
    else:
        if noise is None and not params.greedy:
            noise = make_noise(model, seed, fidelity)
        yield from _frames_reference_sampler(model, grid, params, im_end_id, max_new_tokens, noise, fidelity)


def _frames_engine_sampler(model: DualAR, grid: Tensor | np.ndarray, params: SamplingParams,
                           im_end_id: int, max_new_tokens: int, seed: int,
                           frame_offset: int) -> Iterator[Tensor]:
    cfg = model.config
    C = cfg.num_codebooks
    grid, steps = _check_prompt(model, grid, max_new_tokens)
    T = grid.shape[1]
    dev = model.device
    s1 = cfg.family == "s1"
    if getattr(model, "allowed_ids", None) is None or int(model.allowed_ids[-1]) != im_end_id:
        model.set_allowed_tokens([im_end_id])
    n_sem = cfg.codebook_size
    n_res = cfg.residual_codebook_size
    bs = BatchSampling.from_params([params], [seed], dev)
    slow_cache = model.new_slow_cache(1, T + steps)
    fast_cache = model.new_fast_cache(1)
    win = 16 if s1 else max(params.ras_window, 1)
    main_hist = torch.full((1, win), -1, dtype=torch.long, device=dev)  # allowed-space indices
    code_hist = torch.full((C, 1, win), -1, dtype=torch.long, device=dev)  # S1 penalty windows
    x = grid[None]
    pos = torch.arange(T, device=dev)[None]
    with torch.inference_mode():
        for step in range(steps):
            frame = torch.full((1,), frame_offset + step, dtype=torch.long, device=dev)
            slow_cache.bind(pos)
            out = model.forward_slow(x, pos, slow_cache, head="allowed")
            if s1:
                window = main_hist if step > 0 else main_hist[:, :0]
                idx = s1_main_token(out.logits, bs, frame, window)
            else:
                idx = s2_main_token(out.logits, bs, frame, main_hist, n_sem)
            tok = model.allowed_ids[idx]
            code0 = torch.where(idx < n_sem, idx, torch.zeros_like(idx))
            codes = [code0]
            fast_cache.bind(torch.zeros(1, 1, dtype=torch.long, device=dev))
            model.forward_fast(out.fast_input, 0, fast_cache, n_out=0)
            e = model.fast_embeddings(code0)
            for k in range(1, C):
                fast_cache.bind(torch.full((1, 1), k, dtype=torch.long, device=dev))
                fl = model.forward_fast(e, k, fast_cache, n_out=n_res)
                ck = residual_code(fl, bs, frame, k, cfg.family, code_hist[k] if (s1 and step > 0) else None)
                codes.append(ck)
                e = model.fast_embeddings(ck)
            column = torch.cat([tok.view(1)] + [c.view(1) for c in codes]).long()
            yield column
            if int(tok) == im_end_id:
                return
            if step > 0:  # the prefill frame never enters a repetition window
                main_hist = torch.cat([main_hist[:, 1:], idx.view(1, 1)], dim=1)
                code_hist = torch.cat([code_hist[:, :, 1:], column[1:].view(C, 1, 1)], dim=2)
            x = column.view(1, C + 1, 1)
            pos = torch.full((1, 1), T + step, dtype=torch.long, device=dev)


def _frames_reference_sampler(model: DualAR, grid: Tensor | np.ndarray, params: SamplingParams,
                              im_end_id: int, max_new_tokens: int, noise: NoiseSource | None,
                              fidelity: Fidelity) -> Iterator[Tensor]:
    cfg = model.config
    C = cfg.num_codebooks
    grid, steps = _check_prompt(model, grid, max_new_tokens)
    T = grid.shape[1]
    s1 = cfg.family == "s1"
    dev = model.device
    slow_cache = model.new_slow_cache(1, T + steps)
    fast_cache = model.new_fast_cache(1)
    constrain = (not s1) or fidelity.s1_constrain_semantic
    vocab_mask = allowed_main_tokens(model, im_end_id) if constrain else None
    residual_ids = cfg.residual_codebook_size
    ras: list[int] = []
    s1_win = _S1Windows(16, fidelity.s1_reference_penalty_window)

    def s1_sample(logits: Tensor, window: Tensor | None, vocab: int) -> Tensor:
        if vocab_mask is not None and logits.shape[-1] == vocab_mask.shape[0]:
            logits = logits.masked_fill(~vocab_mask, float("-inf"))
        penalty = params.repetition_penalty
        if params.greedy:
            return torch.argmax(apply_repetition_penalty(logits, penalty, window), dim=-1)
        probs = s1_logits_to_probs(logits, params.temperature, params.top_p, penalty, window)
        q = noise.draw(vocab)
        return race(probs if q.dtype == probs.dtype else probs.float(), q)

    x = grid[None]
    pos = torch.arange(T, device=dev)[None]
    with torch.inference_mode():
        for step in range(steps):
            slow_cache.bind(pos)
            out = model.forward_slow(x, pos, slow_cache)
            logits = out.logits
            if s1:
                window = s1_win.slow_ids(C + 1, dev) if step > 0 else None
                tok = s1_sample(logits, window, logits.shape[-1])
            else:
                normal = sample_s2(logits, [params], noise, vocab_mask)
                high = sample_s2(logits, [params], noise, vocab_mask, high=True)
                tok = normal
                if params.ras_window and int(normal) in ras[-params.ras_window:] and bool(
                        model.is_semantic(normal)):
                    tok = high
            code0 = (tok - cfg.semantic_begin_id).clamp(0, cfg.codebook_size - 1)
            codes = [code0]
            fast_cache.bind(torch.zeros(1, 1, dtype=torch.long, device=dev))
            model.forward_fast(out.fast_input, 0, fast_cache)
            e = model.fast_embeddings(code0)
            for k in range(1, C):
                fast_cache.bind(torch.full((1, 1), k, dtype=torch.long, device=dev))
                fl = model.forward_fast(e, k, fast_cache)
                if s1:
                    fwin = s1_win.fast_ids(k, C + 1, dev) if step > 0 else None
                    ck = s1_sample(fl[:, :residual_ids], fwin, residual_ids)
                else:
                    fmask = None
                    if fidelity.mask_residual_codes:
                        fmask = torch.arange(fl.shape[-1], device=dev) < residual_ids
                    ck = sample_s2(fl, [params], noise, fmask)
                codes.append(ck)
                e = model.fast_embeddings(ck)
            column = torch.cat([tok.view(1)] + [c.view(1) for c in codes]).long()
            yield column
            if int(tok) == im_end_id:
                return
            if step > 0:
                ras.append(int(tok))
                s1_win.columns.append(column)
            x = column.view(1, C + 1, 1)
            pos = torch.full((1, 1), T + step, dtype=torch.long, device=dev)


def generate(model: DualAR, grid: Tensor | np.ndarray, params: SamplingParams, im_end_id: int,
             max_new_tokens: int = 0, *, seed: int = 0, frame_offset: int = 0,
             noise: NoiseSource | None = None, fidelity: Fidelity = Fidelity()) -> GenerationResult:
    """Generate one text batch; returns the kept frames and every raw column."""
    t0 = time.perf_counter()
    cols: list[Tensor] = []
    prefill_s = 0.0
    for col in generate_frames(model, grid, params, im_end_id, max_new_tokens, seed=seed,
                               frame_offset=frame_offset, noise=noise, fidelity=fidelity):
        if not cols:
            prefill_s = time.perf_counter() - t0
        cols.append(col)
    total = time.perf_counter() - t0
    C = model.config.num_codebooks
    columns = torch.stack(cols, dim=1) if cols else torch.zeros(C + 1, 0, dtype=torch.long)
    eos = bool(cols) and int(cols[-1][0]) == im_end_id
    keep = columns.shape[1] - 1 if (eos or fidelity.drop_last_frame) else columns.shape[1]
    keep = max(keep, 0)
    return GenerationResult(
        codes=columns[1:, :keep].cpu().numpy().astype(np.int64),
        columns=columns.cpu(),
        stop_reason="eos" if eos else "length",
        prompt_len=int(np.asarray(grid).shape[1]),
        prefill_s=prefill_s,
        decode_s=total - prefill_s,
    )
