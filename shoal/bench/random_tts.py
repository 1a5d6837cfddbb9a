"""A complete random-weight model bundle (DualAR + tokenizer + codec) for serving benchmarks.

``shoal serve --random-model s2-pro`` serves the DualAR at the real S2-Pro shapes (4.56B
parameters, bf16 on CUDA) and the real-size codec (391M parameters), both with random weights
drawn directly on the device: no checkpoint on disk, no download. Serving speed does not
depend on weight values, so this measures the HTTP server and the realtime WebSocket at the
real shapes; the audio is noise. ``tiny`` is the same bundle at a small size (CPU tests).

The tokenizer has the real S2 id layout: a byte-level BPE trained on shoal's demo and benchmark
texts, padded so that the added tokens take the ids of the S2 tokenizer (``<|endoftext|>`` =
151643, ``<|im_start|>`` = 151644, ``<|im_end|>`` = 151645, ``<|pad|>`` = 151669 ...,
``<|semantic:0..4095|>`` = 151678..155773; 155,774 ids, the model's vocab 155,776). Its BPE is
smaller than Qwen3's, so a text takes a few more tokens (about 3.2 characters per token in
English and 1.0 in Chinese, against roughly 4 and 1.4): prefill is, if anything, overstated.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..model.config import ModelConfig
from ..text.tokenizer import HFTokenizer
from .random_model import S2_IM_END, S2_SEMANTIC_BEGIN, random_codec, random_dualar, s2_pro_config, tiny_config

RANDOM_MODELS: dict[str, Callable[[], ModelConfig]] = {"s2-pro": s2_pro_config, "tiny": tiny_config}
S2_FIRST_ADDED_ID = 151643  # <|endoftext|>: the Qwen BPE fills ids 0..151642
TOKENIZER_BPE_SIZE = 4096


def _bpe_corpus() -> list[str]:
    from ..demo import demo_corpus
    from .corpus import load_corpus

    return demo_corpus() + [t.text for t in load_corpus()]


def s2_layout_tokenizer_json(bpe_vocab_size: int = TOKENIZER_BPE_SIZE) -> str:
    """``tokenizer.json`` text of a small BPE whose special and semantic ids are S2-Pro's."""
    from ..demo import _train_s2_tokenizer

    data = json.loads(_train_s2_tokenizer(bpe_vocab_size, _bpe_corpus()).to_str())
    vocab: dict[str, int] = data["model"]["vocab"]
    n = len(vocab)
    # ids the BPE never produces (no merge builds them), so the added tokens land on S2's ids
    vocab.update({f"<|unused:{i}|>": i for i in range(n, S2_FIRST_ADDED_ID)})
    for token in data["added_tokens"]:
        token["id"] += S2_FIRST_ADDED_ID - n
    return json.dumps(data, ensure_ascii=False)


def s2_layout_tokenizer(bpe_vocab_size: int = TOKENIZER_BPE_SIZE) -> HFTokenizer:
    """The tokenizer of :func:`s2_layout_tokenizer_json`, checked against the S2 ids."""
    with tempfile.TemporaryDirectory(prefix="shoal-random-tok-") as d:
        path = Path(d) / "tokenizer.json"
        path.write_text(s2_layout_tokenizer_json(bpe_vocab_size), encoding="utf-8")
        tok = HFTokenizer(path)
    if (tok.semantic_begin_id, tok.im_end_id) != (S2_SEMANTIC_BEGIN, S2_IM_END):
        raise AssertionError(f"random tokenizer ids {tok!r} are not S2's")
    return tok


def random_model_config(name: str) -> ModelConfig:
    try:
        return RANDOM_MODELS[name]()
    except KeyError:
        raise ValueError(f"unknown random model {name!r}; choose one of {', '.join(RANDOM_MODELS)}") from None


def random_tts(name: str, device: str | None = None, dtype: str | None = None, seed: int = 0,
               quantization: str | None = None, codec_dtype: str | None = None):
    """A :class:`~shoal.tts.TTS` with random weights at the shapes of ``name`` (``s2-pro`` | ``tiny``):
    the DualAR in ``dtype`` (auto: bf16 on CUDA), the codec in ``codec_dtype`` (as ``TTS.load``: auto
    by default, i.e. bf16 decode + fp32 encode on CUDA, fp32 on CPU)."""
    from ..checkpoint import resolve_codec_dtypes, resolve_device, resolve_dtype
    from ..tts import TTS

    config = random_model_config(name)
    dev = resolve_device(device)
    dt = resolve_dtype(dtype, dev)
    tokenizer = s2_layout_tokenizer()
    model = random_dualar(config, device=dev, dtype=dt, seed=seed, quantization=quantization)
    enc_dt, dec_dt = resolve_codec_dtypes(codec_dtype, dev)
    codec = random_codec(device=dev, dtype=enc_dt, seed=seed, config=_codec_config(name), decode_dtype=dec_dt)
    return TTS(model, tokenizer, codec)


def _codec_config(name: str):
    """None (the real-size codec) for ``s2-pro``; the demo checkpoints' tiny codec for ``tiny``."""
    if name != "tiny":
        return None
    from ..codec.config import CodecConfig
    from ..demo import TINY_CODEC_CONFIG

    return CodecConfig.from_dict(TINY_CODEC_CONFIG)


def parameter_count(tts) -> tuple[int, int]:
    """(DualAR, codec) parameters."""
    return (sum(p.numel() for p in tts.model.parameters()), sum(p.numel() for p in tts.codec.parameters()))
