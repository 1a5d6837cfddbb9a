"""Text -> codes -> audio for one request: the library face of ``shoal say``.

This composes the pieces (tokenizer + prompt session, DualAR + reference generate loop, codec)
for a single request. The batched serving path lives in ``shoal.engine``.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from .checkpoint import codec_path, load_dualar, resolve_codec_dtypes, resolve_device, resolve_dtype
from .codec import Codec, load_audio, load_codec
from .engine.generate import Fidelity, GenerationResult, generate, make_noise
from .engine.sampling import SamplingParams
from .model.dualar import DualAR
from .text import Reference, TextTokenizer, build_session


@dataclass
class Synthesis:
    audio: np.ndarray  # float32 mono at ``sample_rate``
    codes: np.ndarray  # int64 [10, frames], all text batches concatenated
    sample_rate: int
    batches: list[GenerationResult] = field(default_factory=list)
    seed: int = 0
    timings: dict[str, float] = field(default_factory=dict)


class TTS:
    def __init__(self, model: DualAR, tokenizer: TextTokenizer, codec: Codec) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.codec = codec

    @classmethod
    def load(cls, checkpoint: str | Path, device: str | None = None, dtype: str | None = None,
             codec: str | Path | None = None, quantization: str | None = None,
             codec_dtype: str | None = None) -> "TTS":
        """``codec_dtype``: the codec's precision (:func:`~shoal.checkpoint.resolve_codec_dtypes`):
        ``auto`` (default) decodes in bf16 and encodes in fp32 on CUDA, fp32 on CPU; ``fp32`` /
        ``bf16`` put the whole codec in that precision (bf16 decode is ~33 dB SNR against
        fp32, see docs/codec.md)."""
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        model, tokenizer = load_dualar(checkpoint, device=dev, dtype=dt, quantization=quantization)
        enc_dt, dec_dt = resolve_codec_dtypes(codec_dtype, dev)
        codec_model = load_codec(codec_path(codec or checkpoint), device=dev, dtype=enc_dt, decode_dtype=dec_dt)
        return cls(model, tokenizer, codec_model)

    @property
    def family(self) -> str:
        return self.model.config.family

    @property
    def sample_rate(self) -> int:
        return self.codec.sample_rate

    def encode_reference(self, audio: str | Path | bytes | np.ndarray) -> np.ndarray:
        """Reference audio (a file, its bytes, or float samples at 44.1 kHz) -> codes [10, T]."""
        samples = audio if isinstance(audio, np.ndarray) else load_audio(audio)
        x = torch.as_tensor(samples, dtype=torch.float32, device=self.model.device)[None, None]
        with torch.inference_mode():
            codes, lengths = self.codec.encode(x)  # cast to the encode side's precision
        return codes[0, :, : int(lengths[0])].cpu().numpy().astype(np.int64)

    def decode(self, codes: np.ndarray) -> np.ndarray:
        if codes.shape[1] == 0:
            return np.zeros(0, dtype=np.float32)
        c = torch.as_tensor(codes, dtype=torch.long, device=self.model.device)[None]
        with torch.inference_mode():
            wav = self.codec.decode(c)
        return wav[0, 0].float().cpu().numpy()

    def synthesize(self, text: str, references: list[Reference] | None = None,
                   params: SamplingParams = SamplingParams(), seed: int | None = None,
                   max_new_tokens: int = 1024, chunk_length: int | None = None,
                   fidelity: Fidelity = Fidelity()) -> Synthesis:
        seed = secrets.randbits(31) if seed is None else int(seed)
        t0 = time.perf_counter()
        session = build_session(self.family, self.tokenizer, text, references or [], chunk_length)
        noise = None if params.greedy else make_noise(self.model, seed, fidelity)
        results: list[GenerationResult] = []
        frames = 0  # the request's frame index keys its noise across text batches
        while not session.done():
            res = generate(self.model, session.grid(), params, self.tokenizer.im_end_id,
                           max_new_tokens=max_new_tokens, seed=seed, frame_offset=frames,
                           noise=noise, fidelity=fidelity)
            session.commit(res.codes)
            results.append(res)
            frames += res.columns.shape[1]
        t1 = time.perf_counter()
        codes = np.concatenate([r.codes for r in results], axis=1) if results else np.zeros((10, 0), np.int64)
        audio = self.decode(codes)
        t2 = time.perf_counter()
        return Synthesis(audio=audio, codes=codes, sample_rate=self.sample_rate, batches=results,
                         seed=seed, timings={"generate_s": t1 - t0, "decode_s": t2 - t1})
