"""Batched token sampling with the reference numerics (fish-speech spec §5.2-5.3).

Every function takes a batch of rows, each with its own parameters, so one call serves every
request in a decode batch. The random draw is separated from the math: callers pass the
noise (``-log U`` for S2, ``Exp(1)`` for S1) so a request's randomness comes from its own
generator and does not depend on its neighbours in the batch.

S2 (HEAD) rule, per row:
  1. sort logits descending; ``cum = cumsum(softmax(sorted))`` (untempered);
  2. drop ranks with ``cum > top_p`` or ``rank >= top_k``; rank 0 is always kept;
  3. ``softmax(logits / max(temperature, 1e-5))`` over the kept set;
  4. token = ``argmax(probs / q)`` with ``q = -log U`` (the exponential race).
S1 (d3df505) applies a repetition penalty before step 1, has no top_k, and draws ``q ~ Exp(1)``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings. ``greedy`` is a true argmax (no random draw)."""

    temperature: float = 0.8
    top_p: float = 0.8
    top_k: int = 30
    greedy: bool = False
    repetition_penalty: float = 1.0  # S1 models only; S2 uses RAS instead
    ras_window: int = 10
    ras_temperature: float = 1.0
    ras_top_p: float = 0.9

    def validate(self) -> None:
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 < self.temperature < 2.0 and not self.greedy:
            raise ValueError(f"temperature must be in (0, 2), got {self.temperature}")
        if self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not 0.0 < self.repetition_penalty < 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2), got {self.repetition_penalty}")
        if self.ras_window < 0:
            raise ValueError("ras_window must be >= 0")


def _column(values: Tensor | float | int, rows: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    t = torch.as_tensor(values, device=device)
    if t.dim() == 0:
        t = t.expand(rows)
    return t.to(dtype).reshape(rows, 1)


def logits_to_probs(logits: Tensor, temperature: Tensor | float, top_p: Tensor | float,
                    top_k: Tensor | int) -> Tensor:
    """S2 rule, batched: logits [B, V] -> probs [B, V] (zero outside the kept set).

    ``temperature``/``top_p`` are cast to the logits dtype, as the reference holds them in the
    model dtype (bf16: top_p 0.9 -> 0.8984375).
    """
    return probs_from_sorted(logits, sort_cumulative(logits), temperature, top_p, top_k)


def sort_cumulative(logits: Tensor, fp32_sum: bool = False) -> tuple[Tensor, Tensor]:
    """(sorted indices, cumulative untempered probabilities in sorted order): the part of the
    S2 rule that does not depend on the parameters, shareable between draws on one logits row.

    ``fp32_sum`` keeps the running sum of bf16 / fp16 probabilities in fp32 (each value rounded
    to the logits dtype), as PyTorch's CPU cumsum does; without it a bf16 cumsum on CUDA rounds
    the running sum itself at every step (the reference's numerics on its GPU). The engine's
    sampler uses fp32 sums and a stable sort so that its draws agree on CPU, on GPU and with
    the fused kernels up to the summation order (CUDA scans in a tree, the kernels in rank
    order, PyTorch's CPU cumsum of fp32 values in double): a cumulative value can round
    differently only right at the top_p boundary."""
    # the engine's order for equal logits is the stable one (lower index first), as in the kernels
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True, stable=fp32_sum)
    probs = torch.softmax(sorted_logits, dim=-1)
    if fp32_sum and probs.dtype != torch.float32:
        return sorted_idx, torch.cumsum(probs.float(), dim=-1).to(probs.dtype)
    return sorted_idx, torch.cumsum(probs, dim=-1)


def probs_from_sorted(logits: Tensor, sorted_cum: tuple[Tensor, Tensor], temperature: Tensor | float,
                      top_p: Tensor | float, top_k: Tensor | int) -> Tensor:
    B, V = logits.shape
    sorted_idx, cum = sorted_cum
    temp = _column(temperature, B, logits.dtype, logits.device)
    p = _column(top_p, B, logits.dtype, logits.device)
    k = _column(top_k, B, torch.long, logits.device)
    ranks = torch.arange(V, device=logits.device)[None, :]
    remove = (cum > p) | (ranks >= k)
    remove[:, 0].fill_(False)
    remove = remove.scatter(1, sorted_idx, remove)
    logits = logits.masked_fill(remove, float("-inf"))
    logits = logits / torch.clamp(temp, min=1e-5)
    return torch.softmax(logits, dim=-1)


def apply_repetition_penalty(logits: Tensor, penalty: Tensor | float, window: Tensor | None) -> Tensor:
    """S1 penalty at the ``window`` ids [B, W] (-1 = empty slot): a logit is divided by the
    penalty when positive and multiplied when negative (fp32 math, rounded to the logits dtype)."""
    if window is None or not window.numel():
        return logits
    B = logits.shape[0]
    r = _column(penalty, B, torch.float32, logits.device)
    valid = window >= 0
    ids = window.clamp(min=0)
    original = torch.gather(logits, 1, ids)
    score = original.float()
    score = torch.where(score < 0, score * r, score / r).to(logits.dtype)
    return logits.scatter(1, ids, torch.where(valid, score, original))


def s1_logits_to_probs(logits: Tensor, temperature: Tensor | float, top_p: Tensor | float,
                       penalty: Tensor | float, window: Tensor | None) -> Tensor:
    """S1 rule, batched: repetition penalty at ``window`` ids [B, W] (-1 = empty), then top-p
    and temperature. Parameters are fp32; results are rounded to the logits dtype and the
    top-p comparison uses top_p rounded to the logits dtype, as the reference does."""
    B, V = logits.shape
    dt = logits.dtype
    temp = _column(temperature, B, torch.float32, logits.device)
    p = _column(top_p, B, torch.float32, logits.device)
    logits = apply_repetition_penalty(logits, penalty, window)
    sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
    cum = torch.cumsum(torch.softmax(sorted_logits, dim=-1), dim=-1)
    remove = cum > p.to(dt)
    remove[:, 0].fill_(False)
    remove = remove.scatter(1, sorted_idx, remove)
    logits = logits.masked_fill(remove, float("-inf"))
    logits = (logits.float() / torch.clamp(temp, min=1e-5)).to(dt)
    return torch.softmax(logits, dim=-1)


def race(probs: Tensor, q: Tensor) -> Tensor:
    """The exponential race: argmax(probs / q) per row, first index on ties -> [B] int64."""
    return torch.argmax(probs / q, dim=-1)


class NoiseSource:
    """Per-request random draws for the exponential race.

    Each row owns a ``torch.Generator`` seeded from its request seed, so a request's draws are
    the same alone or in any batch. ``dtype`` is the dtype of the uniform draw: fp32 by default;
    the reference draws in the model dtype (bf16 has 8 random bits, so U = 0 -> q = inf happens
    with probability 1/256 and can force token 0 -- see docs/fidelity.md).
    """

    def __init__(self, seeds: list[int], device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, exponential: bool = False) -> None:
        self.device = torch.device(device)
        self.dtype = dtype
        self.exponential = exponential
        self.generators = []
        for s in seeds:
            g = torch.Generator(device=self.device)
            g.manual_seed(int(s))
            self.generators.append(g)

    def draw(self, vocab: int) -> Tensor:
        """[B, vocab] of ``-log U`` (or ``Exp(1)`` in S1 mode), one row per generator."""
        rows = []
        for g in self.generators:
            if self.exponential:
                rows.append(torch.empty(vocab, dtype=self.dtype, device=self.device).exponential_(1, generator=g))
            else:
                u = torch.rand(vocab, dtype=self.dtype, device=self.device, generator=g)
                rows.append(-torch.log(u))
        return torch.stack(rows)


def sample_s2(logits: Tensor, params: list[SamplingParams], noise: NoiseSource | None,
              vocab_mask: Tensor | None = None, high: bool = False) -> Tensor:
    """Sample one token per row with the S2 rule. ``vocab_mask`` [V] bool marks allowed ids.

    ``high`` uses each row's RAS fallback settings. Rows with ``greedy`` take the argmax of the
    (masked) logits without consuming randomness semantics beyond the shared draw.
    """
    if vocab_mask is not None:
        logits = logits.masked_fill(~vocab_mask, float("-inf"))
    B = logits.shape[0]
    greedy = torch.tensor([p.greedy for p in params], device=logits.device)
    if bool(greedy.all()) or noise is None:
        if not bool(greedy.all()):
            raise ValueError("a NoiseSource is needed for non-greedy rows")
        return torch.argmax(logits, dim=-1)
    temp = [p.ras_temperature if high else p.temperature for p in params]
    top_p = [p.ras_top_p if high else p.top_p for p in params]
    top_k = [p.top_k for p in params]
    probs = logits_to_probs(logits, torch.tensor(temp), torch.tensor(top_p), torch.tensor(top_k))
    q = noise.draw(logits.shape[-1]).to(probs.dtype if noise.dtype == probs.dtype else torch.float32)
    sampled = race(probs if q.dtype == probs.dtype else probs.float(), q)
    return torch.where(greedy, torch.argmax(logits, dim=-1), sampled)


# --------------------------------------------------------------------------- counter-based noise
# The engine samples every row of a batch in one kernel sequence, inside CUDA graphs, so the
# noise cannot come from per-request torch.Generators. Instead each uniform is a pure function
# of (request seed, counter, vocabulary index): a stateless integer hash evaluated on the
# device. The same request draws the same noise alone or in any batch, on CPU or GPU, and after
# a preemption. counter = frame * DRAWS_PER_FRAME + draw (0: main token, 1: RAS fallback,
# 2..10: residual codebooks 1..9).

DRAWS_PER_FRAME = 16
_M32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # < 2^27, so products of 32-bit values stay far below 2^63
FLT_MIN = 1.1754943508222875e-38


def _mix32(x: Tensor) -> Tensor:
    x = (((x >> 16) ^ x) * _MULT) & _M32
    x = (((x >> 16) ^ x) * _MULT) & _M32
    return (x >> 16) ^ x


def hash_uniform(seed: Tensor, counter: Tensor, n: int) -> Tensor:
    """fp32 uniforms in (0, 1], exactly reproducible on any device: [B, n] for ``counter`` [B],
    or [B, K, n] for ``counter`` [B, K] (several draws in one pass).

    ``seed`` is int64 [B]; 24 random bits per draw, never 0.
    """
    s = seed.long()
    c = counter.long()
    if c.dim() == 2:
        s = s[:, None]
    key = _mix32((s & _M32) ^ _mix32(((s >> 32) & _M32) ^ _mix32(c & _M32)))
    idx = torch.arange(n, device=seed.device, dtype=torch.long)
    h = _mix32(key[..., None] ^ _mix32((idx * 0x9E37 + 0x7F4A7C15) & _M32))
    return ((h >> 8) + 1).to(torch.float32) * (1.0 / (1 << 24))


def hash_exponential(seed: Tensor, counter: Tensor, n: int) -> Tensor:
    """[B, n] fp32 Exp(1) draws ``-log U`` for the exponential race, floored at the smallest
    normal fp32: U == 1 (one draw in 2^24) would give q == 0, and ``0 / 0`` = NaN would win the
    argmax for an entry outside the nucleus; with the floor such an entry scores 0 and a kept
    one wins, as an Exp(1) draw that small should."""
    return torch.clamp_min(-torch.log(hash_uniform(seed, counter, n)), FLT_MIN)


@dataclass
class BatchSampling:
    """Per-row sampling parameters as device tensors (one row per running request)."""

    temperature: Tensor  # [B] fp32
    top_p: Tensor  # [B] fp32
    top_k: Tensor  # [B] int64
    greedy: Tensor  # [B] bool
    ras_temperature: Tensor  # [B] fp32
    ras_top_p: Tensor  # [B] fp32
    ras_window: Tensor  # [B] int64 (0 disables RAS)
    repetition_penalty: Tensor  # [B] fp32 (S1)
    seed: Tensor  # [B] int64

    @classmethod
    def from_params(cls, params: list[SamplingParams], seeds: list[int],
                    device: torch.device | str = "cpu") -> "BatchSampling":
        def t(vals, dtype):
            return torch.tensor(vals, dtype=dtype, device=device)

        return cls(
            temperature=t([p.temperature for p in params], torch.float32),
            top_p=t([p.top_p for p in params], torch.float32),
            top_k=t([p.top_k for p in params], torch.long),
            greedy=t([p.greedy for p in params], torch.bool),
            ras_temperature=t([p.ras_temperature for p in params], torch.float32),
            ras_top_p=t([p.ras_top_p for p in params], torch.float32),
            ras_window=t([p.ras_window for p in params], torch.long),
            repetition_penalty=t([p.repetition_penalty for p in params], torch.float32),
            seed=t([int(s) & ((1 << 63) - 1) for s in seeds], torch.long),
        )

    def fields(self) -> dict[str, Tensor]:
        return dict(self.__dict__)

    def copy_(self, other: "BatchSampling", rows: int) -> None:
        """Copy ``other`` (B' <= capacity rows) into the first rows of this fixed-address buffer."""
        for name, dst in self.__dict__.items():
            dst[:rows].copy_(getattr(other, name))

    @classmethod
    def empty(cls, capacity: int, device: torch.device | str) -> "BatchSampling":
        return cls.from_params([SamplingParams(greedy=True)] * capacity, [0] * capacity, device)


def sample_rows(logits: Tensor, temperature: Tensor, top_p: Tensor, top_k: Tensor, greedy: Tensor,
                q: Tensor, sorted_cum: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The S2 rule for a batch with per-row parameters and given race noise ``q`` [B, V].

    Greedy rows take the first argmax of the logits. Parameters are rounded to the logits dtype
    like the reference's model-dtype tensors. No host synchronisation.
    """
    probs = probs_from_sorted(logits, sorted_cum or sort_cumulative(logits, fp32_sum=True), temperature, top_p, top_k)
    sampled = torch.argmax(probs.float() / q, dim=-1)
    return torch.where(greedy, torch.argmax(logits, dim=-1), sampled)


def s2_main_token(logits: Tensor, bs: BatchSampling, frame: Tensor, window: Tensor,
                  semantic_count: int) -> Tensor:
    """Main token over the *allowed* logits [B, A] (A = semantic ids then <|im_end|>), with RAS.

    ``window`` [B, W] holds allowed-space indices of each row's last main tokens (-1 = empty),
    newest last; only the last ``ras_window`` entries of a row count. Returns allowed-space
    indices [B]. Two draws per frame (normal, RAS fallback), as in the reference.
    """
    A = logits.shape[-1]
    counter = frame * DRAWS_PER_FRAME
    q = hash_exponential(bs.seed, torch.stack([counter, counter + 1], dim=1), A)  # both draws at once
    sc = sort_cumulative(logits, fp32_sum=True)  # one sort serves both draws
    normal = sample_rows(logits, bs.temperature, bs.top_p, bs.top_k, bs.greedy, q[:, 0], sc)
    high = sample_rows(logits, bs.ras_temperature, bs.ras_top_p, bs.top_k, bs.greedy, q[:, 1], sc)
    W = window.shape[1]
    live = torch.arange(W, device=window.device)[None, :] >= (W - bs.ras_window)[:, None]
    repeated = ((window == normal[:, None]) & live).any(dim=1)
    use_high = repeated & (normal < semantic_count) & ~bs.greedy
    return torch.where(use_high, high, normal)


def s1_main_token(logits: Tensor, bs: BatchSampling, frame: Tensor, window: Tensor) -> Tensor:
    """S1 main token over allowed logits [B, A] with the repetition penalty at ``window``
    (allowed-space ids, -1 = empty), top-p and temperature; no top-k. Returns allowed indices."""
    A = logits.shape[-1]
    penalised = apply_repetition_penalty(logits, bs.repetition_penalty, window)
    probs = s1_logits_to_probs(penalised, bs.temperature, bs.top_p, 1.0, None)
    q = hash_exponential(bs.seed, frame * DRAWS_PER_FRAME, A)
    sampled = torch.argmax(probs.float() / q, dim=-1)
    return torch.where(bs.greedy, torch.argmax(penalised, dim=-1), sampled)


def residual_noise(bs: BatchSampling, frame: Tensor, num_codebooks: int, n: int) -> Tensor:
    """[B, C, n] race noise of all residual codebooks of a frame (index k = codebook k; row 0
    unused), computed in one pass: the draws do not depend on the sampled values."""
    ks = torch.arange(num_codebooks, device=frame.device)
    return hash_exponential(bs.seed, frame[:, None] * DRAWS_PER_FRAME + 1 + ks[None, :], n)


def residual_code(logits: Tensor, bs: BatchSampling, frame: Tensor, k: int, family: str,
                  window: Tensor | None = None, noise: Tensor | None = None) -> Tensor:
    """Code of residual codebook ``k`` (1..9) from fast logits already cut to the valid entries.
    ``noise`` [B, n]: this codebook's slice of :func:`residual_noise` (computed here if None)."""
    n = logits.shape[-1]
    q = noise if noise is not None else hash_exponential(bs.seed, frame * DRAWS_PER_FRAME + 1 + k, n)
    if family == "s1":
        penalised = apply_repetition_penalty(logits, bs.repetition_penalty, window)
        probs = s1_logits_to_probs(penalised, bs.temperature, bs.top_p, 1.0, None)
        return torch.where(bs.greedy, torch.argmax(penalised, dim=-1), torch.argmax(probs.float() / q, dim=-1))
    return sample_rows(logits, bs.temperature, bs.top_p, bs.top_k, bs.greedy, q)
