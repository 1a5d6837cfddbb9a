"""Tiny random-weight checkpoints in the real Fish Speech on-disk formats.

Two writers produce complete, self-contained model directories:

* :func:`write_tiny_s2_checkpoint` -- the S2-Pro layout (``fish_qwen3_omni``
  ``config.json``, HF ``tokenizer.json`` + ``tokenizer_config.json`` +
  ``special_tokens_map.json``, bf16 safetensors shards with S2 key names and
  ``model.safetensors.index.json``).
* :func:`write_tiny_s1_checkpoint` -- the openaudio-s1-mini layout (flat
  ``dual_ar`` ``config.json``, ``tokenizer.tiktoken``, ``special_tokens.json``,
  a plain bf16 state dict in ``model.pth``).

Both add a tiny random codec (``codec.pth`` + ``codec_config.json``) through
:mod:`shoal.codec.random_init`.  The files go through exactly the loading
path a user's downloaded checkpoint goes through; only the sizes are small.
The output is a pure function of the arguments: the same seed gives
byte-identical files.

:func:`default_checkpoint` is shoal's built-in demo model: generated once
into the cache directory and reused, so ``shoal say "hi" -o out.wav`` works on
a fresh machine without downloading weights (the audio is not speech).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator

import torch

__all__ = [
    "DEFAULT_CHECKPOINT_NAME",
    "DEFAULT_SEED",
    "S1_SPECIAL_TOKENS",
    "S1_TIKTOKEN_PATTERN",
    "S2_FISH_SPECIAL_TOKENS",
    "TINY_CODEC_CONFIG",
    "default_cache_root",
    "default_checkpoint",
    "demo_corpus",
    "write_tiny_s1_checkpoint",
    "write_tiny_s2_checkpoint",
]

from .model.loader import s2_disk_key

DEFAULT_CHECKPOINT_NAME = "default-s2-tiny-v1"
DEFAULT_SEED = 2026

CODEBOOK_SIZE = 4096
NUM_CODEBOOKS = 10
VOCAB_MULTIPLE = 64
SEMANTIC_TOKENS = [f"<|semantic:{i}|>" for i in range(CODEBOOK_SIZE)]

# ---------------------------------------------------------------------------
# Special-token tables
# ---------------------------------------------------------------------------

# Qwen base specials, then the 23 further Qwen3 added tokens (the first 11 are
# special, the rest are ordinary added tokens), as in the S2 tokenizer.
_QWEN_BASE_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
_QWEN3_EXTRA_SPECIAL = [
    "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>", "<|box_end|>",
    "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
    "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>",
]
_QWEN3_EXTRA_PLAIN = [
    "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
    "<tool_response>", "</tool_response>", "<think>", "</think>",
]
# fish-speech (HEAD) ALL_SPECIAL_TOKENS without the semantic block; this is also
# the order of `additional_special_tokens` in the S2 tokenizer_config.json.
S2_FISH_SPECIAL_TOKENS = [
    "<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>",
    "<|phoneme_start|>", "<|phoneme_end|>", "<|text|>", "<|voice|>",
    "<|interleave|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
]
# fish-speech S1 (openaudio-s1-mini) ALL_SPECIAL_TOKENS without the semantic block.
S1_SPECIAL_TOKENS = [
    "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|im_start|>", "<|im_end|>",
    "<|phoneme_start|>", "<|phoneme_end|>", "<|tool_call_start|>", "<|tool_call_end|>",
    "<|text|>", "<|voice|>", "<|interleave|>", "<|audio_start|>", "<|audio_end|>",
    "<|audio|>",
]

# Qwen2 pre-tokenizer split pattern (S2 tokenizer.json).
_QWEN2_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# S1 tiktoken pattern (with its escaped-lookahead quirk): the tokenizer's own.
from .text.tokenizer import S1_TIKTOKEN_PATTERN  # noqa: E402

# Hyper-parameters of the tiny codec (the golden `codec_tiny` values).
TINY_CODEC_CONFIG: dict = {
    "format": "fish-speech modded DAC (fish_speech.models.dac.modded_dac.DAC + rvq.DownsampleResidualVectorQuantize)",
    "sample_rate": 44100,
    "causal": True,
    "encoder_dim": 4,
    "encoder_rates": [2, 4, 8, 8],
    "latent_dim": 64,
    "encoder_block_dims": [8, 16, 32, 64],
    "encoder_transformer_layers": [0, 0, 0, 1],
    "encoder_transformer": {
        "dim": 64, "n_layer": 1, "n_head": 1, "n_local_heads": 1, "head_dim": 64,
        "intermediate_size": 192, "window_size": 512, "causal": True,
        "rope_base": 10000, "norm_eps": 1e-05,
    },
    "decoder_dim": 64,
    "decoder_rates": [8, 8, 4, 2],
    "decoder_block_channels": [[64, 32], [32, 16], [16, 8], [8, 4]],
    "decoder_transformer_layers": [0, 0, 0, 0],
    "hop_length_encoder": 512,
    "frame_length": 2048,
    "quantizer": {
        "input_dim": 64,
        "downsample_factor": [2, 2],
        "downsample_dims": [64, 64],
        "semantic_codebook_size": 4096,
        "n_semantic_codebooks": 1,
        "codebook_size": 1024,
        "n_codebooks": 9,
        "codebook_dim": 8,
        "convnext_mlp_ratio": 4.0,
        "convnext_kernel_size": 7,
        "convnext_layernorm_eps": 1e-06,
        "pre_module": {
            "dim": 64, "n_layer": 2, "n_head": 2, "n_local_heads": 2, "head_dim": 32,
            "intermediate_size": 192, "window_size": 128, "causal": True,
            "rope_base": 10000, "norm_eps": 1e-05,
        },
        "post_module": {
            "dim": 64, "n_layer": 2, "n_head": 2, "n_local_heads": 2, "head_dim": 32,
            "intermediate_size": 192, "window_size": 128, "causal": True,
            "rope_base": 10000, "norm_eps": 1e-05,
        },
    },
    "layer_scale_init_real": 0.01,
}

# ---------------------------------------------------------------------------
# Training corpus (small, synthetic, deterministic)
# ---------------------------------------------------------------------------

_NAMES = ["Anna", "Ben", "Carla", "Dmitri", "Elena", "Farid", "Grace", "Hiro",
          "Ines", "Jonas", "Keiko", "Luis", "Maya", "Noah", "Olga", "Pavel"]
_SUBJECTS = ["The old fisherman", "A curious child", "My neighbour", "The night train",
             "Our teacher", "She", "He", "They", "We", "The little robot",
             "Every morning the baker", "A tired traveller", "The orchestra",
             "Nobody in the village", "The weather report", "Your sister",
             "A small grey cat", "The new manager", "Most of the students", "I"]
_VERBS = ["walked past", "looked at", "sang about", "painted", "talked about",
          "remembered", "carried", "followed", "waited for", "listened to",
          "forgot", "described", "repaired", "opened", "photographed", "found",
          "counted", "visited", "cleaned", "borrowed", "noticed", "explained"]
_OBJECTS = ["the silver boat", "a bright lantern", "the tall lighthouse", "an empty bottle",
            "the wooden bridge", "a strange letter", "the blue notebook", "two green apples",
            "the noisy market", "a broken umbrella", "the quiet garden", "her favourite song",
            "the last chapter", "a paper kite", "the frozen lake", "his grandfather's watch",
            "the radio station", "a cup of tea", "the mountain road", "three tiny shells"]
_TAILS = ["before sunrise", "in the rain", "after dinner", "near the harbour",
          "for three hours", "on Tuesday", "at the end of the street", "without a word",
          "during the storm", "every single day", "last winter", "with great care",
          "in the middle of the night", "as the bells rang", "under the old bridge",
          "while everyone was sleeping"]
_ADJS = ["quiet", "bright", "strange", "beautiful", "cold", "heavy", "gentle", "loud",
         "ancient", "simple", "careful", "warm", "dark", "happy", "tiny", "enormous"]
_PLURALS = ["birds", "boats", "windows", "questions", "stars", "chairs", "voices",
            "stories", "lamps", "trees", "clouds", "minutes"]
_TEMPLATES = [
    "{S} {V} {O} {T}.",
    "{S} {V} {O}, and then {V2} {O2}.",
    "Did you see {O} {T}?",
    "Why is {O} so {A} today?",
    "How many {P} can you count, {N}?",
    "{N} said, \"I'm sure it's {A}.\"",
    "Don't forget {O}!",
    "It cost ${D}.{D2} and took {D3} minutes.",
    "On {MONTH} {DAY}, {YEAR}, {S2} {V} {O}.",
    "{N} and {N2} weren't ready, but they'd try again {T}.",
    "The {A} {PS} looked {A2}; nobody knew why.",
    "Please call {N} at {D}{D3}-{D2}{D} before {HOUR}:{MIN}.",
    "We've got {D3} {P}, {D} of which are {A}.",
    "What a {A} morning it was!",
    "If {S2} {V} {O}, we'll hear about it {T}.",
    "{N}'s answer was short: \"{A}, {A2}, and {A3}.\"",
]
_MONTHS = ["January", "March", "April", "June", "July", "September", "October", "December"]
_FIXED_LINES = [
    "Hello world, this is a tiny test of the speech system.",
    "Hi! How are you doing today?  I hope everything is fine.",
    "The quick brown fox jumps over the lazy dog.",
    "Café au lait, a naïve résumé and déjà vu — all in one line.",
    "Zoë met Björn in Zürich at 9:30 on 12/05/2024.",
    "Numbers like 3.14159, 2,718 and 42% appear in text too.",
    "Send an e-mail to support@example.com (not to sales).",
    "Wait... what? Really?! That's incredible.",
    "First line\nSecond line\n\nThird line after a blank one.",
    "Tabs\tand  double  spaces   should   survive.",
    "Say it again: one, two, three, four, five, six, seven, eight, nine, ten.",
    "A voice can whisper, shout, laugh, sigh or sing.",
]


def _singular(word: str) -> str:
    return word[:-3] + "y" if word.endswith("ies") else word[:-1]


def demo_corpus(n_sentences: int = 400) -> list[str]:
    """The deterministic English corpus the tiny tokenizers are trained on."""
    lines = list(_FIXED_LINES)
    for i in range(n_sentences):
        def pick(seq, k: int, off: int = 0):
            # Index mixing: a fixed, seed-free walk through each word list;
            # fields sharing `k` with different `off` never coincide.
            return seq[(i * k + (i // len(seq)) * 7 + off) % len(seq)]

        subject = pick(_SUBJECTS, 3)
        fields = {
            "S": subject,
            "S2": subject if subject == "I" else subject[0].lower() + subject[1:],
            "V": pick(_VERBS, 5),
            "V2": pick(_VERBS, 5, 9),
            "O": pick(_OBJECTS, 7),
            "O2": pick(_OBJECTS, 7, 10),
            "T": pick(_TAILS, 9),
            "A": pick(_ADJS, 5),
            "A2": pick(_ADJS, 5, 5),
            "A3": pick(_ADJS, 5, 11),
            "P": pick(_PLURALS, 7),
            "PS": _singular(pick(_PLURALS, 5)),
            "N": pick(_NAMES, 3),
            "N2": pick(_NAMES, 3, 8),
            "D": str((i * 37 + 11) % 100),
            "D2": f"{(i * 53 + 7) % 100:02d}",
            "D3": str((i * 29 + 3) % 60 + 1),
            "MONTH": pick(_MONTHS, 3),
            "DAY": str(i % 28 + 1),
            "YEAR": str(1990 + (i * 7) % 40),
            "HOUR": str(i % 12 + 1),
            "MIN": f"{(i * 15) % 60:02d}",
        }
        lines.append(_TEMPLATES[i % len(_TEMPLATES)].format(**fields))
    return lines


# ---------------------------------------------------------------------------
# Small helpers
# ---------------------------------------------------------------------------


def _round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def _json_text(obj, *, indent: int = 2, sort_keys: bool = True, newline: bool = True) -> str:
    text = json.dumps(obj, indent=indent, sort_keys=sort_keys, ensure_ascii=False)
    return text + "\n" if newline else text


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(text)


def _current_umask() -> int:
    """The process umask, read without changing it where the OS allows."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # fallback: briefly set and restore
    os.umask(mask)
    return mask


@contextlib.contextmanager
def _atomic_dir(out_dir: Path, overwrite: bool) -> Iterator[Path]:
    """Yield a temp dir beside ``out_dir``; on success rename it into place.

    Readers never see a half-written ``out_dir``.  An absent or empty
    ``out_dir`` is simply replaced; a non-empty one raises ``FileExistsError``
    unless ``overwrite`` (then it is swapped out and deleted).
    """
    out_dir = Path(out_dir)
    parent = out_dir.parent
    parent.mkdir(parents=True, exist_ok=True)
    if not overwrite and out_dir.is_dir() and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists and is not empty (pass overwrite=True)")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=parent))
    try:
        yield tmp
        umask = _current_umask()
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes 0700
        for f in tmp.iterdir():  # some writers create 0600 files
            os.chmod(f, 0o666 & ~umask)
        try:
            os.rename(tmp, out_dir)  # atomic; also replaces an empty directory
        except OSError as e:
            if not out_dir.exists():
                raise
            if not overwrite:
                raise FileExistsError(f"{out_dir} appeared while it was being written") from e
            trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=parent))
            os.rename(out_dir, trash / "old")
            os.rename(tmp, out_dir)
            shutil.rmtree(trash, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _write_codec(out_dir: Path, seed: int) -> None:
    from shoal.codec.config import CodecConfig
    from shoal.codec.random_init import write_random_codec

    cfg_path = out_dir / "codec_config.json"
    _write_text(cfg_path, _json_text(TINY_CODEC_CONFIG, sort_keys=False))
    write_random_codec(out_dir, CodecConfig.from_json(cfg_path), seed)


# ---------------------------------------------------------------------------
# Weights
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Shapes:
    vocab_size: int
    dim: int
    n_layer: int
    n_head: int
    n_local_heads: int
    head_dim: int
    intermediate: int
    qk_norm: bool
    untied_output: bool
    fast_dim: int
    n_fast_layer: int
    fast_n_head: int
    fast_n_local_heads: int
    fast_head_dim: int
    fast_intermediate: int
    codebook_size: int = CODEBOOK_SIZE
    num_codebooks: int = NUM_CODEBOOKS


def _layer_shapes(prefix: str, dim: int, n_head: int, n_kv: int, head_dim: int,
                  inter: int, qk_norm: bool) -> list[tuple[str, tuple[int, ...]]]:
    out = [
        (f"{prefix}attention.wqkv.weight", ((n_head + 2 * n_kv) * head_dim, dim)),
        (f"{prefix}attention.wo.weight", (dim, n_head * head_dim)),
    ]
    if qk_norm:
        out += [(f"{prefix}attention.q_norm.weight", (head_dim,)),
                (f"{prefix}attention.k_norm.weight", (head_dim,))]
    out += [
        (f"{prefix}feed_forward.w1.weight", (inter, dim)),
        (f"{prefix}feed_forward.w3.weight", (inter, dim)),
        (f"{prefix}feed_forward.w2.weight", (dim, inter)),
        (f"{prefix}ffn_norm.weight", (dim,)),
        (f"{prefix}attention_norm.weight", (dim,)),
    ]
    return out


def _native_param_shapes(s: _Shapes) -> list[tuple[str, tuple[int, ...]]]:
    """Native (fish-speech) parameter names and shapes, in module order."""
    if s.fast_dim != s.dim:
        raise ValueError("fast_dim must equal dim (no fast_project_in is written)")
    out: list[tuple[str, tuple[int, ...]]] = [
        ("embeddings.weight", (s.vocab_size, s.dim)),
        ("codebook_embeddings.weight", (s.codebook_size * s.num_codebooks, s.dim)),
    ]
    for i in range(s.n_layer):
        out += _layer_shapes(f"layers.{i}.", s.dim, s.n_head, s.n_local_heads,
                             s.head_dim, s.intermediate, s.qk_norm)
    out.append(("norm.weight", (s.dim,)))
    if s.untied_output:
        out.append(("output.weight", (s.vocab_size, s.dim)))
    out.append(("fast_embeddings.weight", (s.codebook_size, s.fast_dim)))
    for i in range(s.n_fast_layer):
        out += _layer_shapes(f"fast_layers.{i}.", s.fast_dim, s.fast_n_head, s.fast_n_local_heads,
                             s.fast_head_dim, s.fast_intermediate, False)
    out.append(("fast_norm.weight", (s.fast_dim,)))
    out.append(("fast_output.weight", (s.codebook_size, s.fast_dim)))
    return out


def _init_rule(name: str) -> tuple[float, float, float]:
    """(outer scale, offset, noise std): value = outer * (offset + std * randn)."""
    if name in ("norm.weight", "fast_norm.weight"):
        return 28.0, 1.0, 0.1  # large final-norm gain -> logits with clear margins
    if name.endswith("norm.weight"):
        return 1.0, 1.0, 0.1
    if name.startswith("fast_layers.") and name.endswith("attention.wqkv.weight"):
        return 1.0, 0.0, 0.15
    if name.endswith("attention.wqkv.weight") or name.endswith("attention.wo.weight"):
        return 1.0, 0.0, 0.05
    return 1.0, 0.0, 0.02


def _native_state_dict(shapes: _Shapes, seed: int, *, zero_rows_from: int | None = None
                       ) -> "OrderedDict[str, torch.Tensor]":
    """bf16 weights drawn in module order from ``torch.Generator().manual_seed(seed)``."""
    gen = torch.Generator().manual_seed(seed)
    sd: OrderedDict[str, torch.Tensor] = OrderedDict()
    for name, shape in _native_param_shapes(shapes):
        outer, offset, std = _init_rule(name)
        w = torch.randn(shape, generator=gen, dtype=torch.float32)
        if offset:
            w = offset + std * w
        else:
            w = std * w
        if outer != 1.0:
            w = outer * w
        sd[name] = w.to(torch.bfloat16).contiguous()
    if zero_rows_from is not None and "output.weight" in sd:
        sd["output.weight"][zero_rows_from:] = 0
    return sd


def _split_shards(names: list[str], sizes: dict[str, int], shards: int) -> list[list[str]]:
    """Cut ``names`` (in order) into ``shards`` non-empty groups of similar byte size."""
    if not 1 <= shards <= len(names):
        raise ValueError(f"shards must be in [1, {len(names)}], got {shards}")
    total = sum(sizes.values())
    groups: list[list[str]] = [[]]
    acc = 0
    for idx, name in enumerate(names):
        left_names = len(names) - idx
        left_groups = shards - len(groups)
        cur = groups[-1]
        must_cut = cur and left_names == left_groups
        want_cut = cur and left_groups > 0 and acc + sizes[name] > total * len(groups) / shards
        if must_cut or want_cut:
            groups.append([])
        groups[-1].append(name)
        acc += sizes[name]
    return groups


# ---------------------------------------------------------------------------
# S2 tokenizer (HF tokenizers, Qwen2-style byte-level BPE)
# ---------------------------------------------------------------------------


def _train_s2_tokenizer(bpe_vocab_size: int, corpus: Iterable[str] | None = None):
    """Qwen2-style byte-level BPE trained on ``corpus`` (default :func:`demo_corpus`), then the
    S2 added tokens in the real order (Qwen specials, Qwen3 extras, fish specials, semantic)."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN2_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=bpe_vocab_size,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(demo_corpus() if corpus is None else corpus, trainer=trainer)

    def added(content: str, special: bool) -> AddedToken:
        return AddedToken(content, single_word=False, lstrip=False, rstrip=False,
                          normalized=False, special=special)

    fish_extra = [t for t in S2_FISH_SPECIAL_TOKENS if t not in _QWEN_BASE_SPECIALS]
    tok.add_special_tokens([added(t, True) for t in _QWEN_BASE_SPECIALS + _QWEN3_EXTRA_SPECIAL])
    tok.add_tokens([added(t, False) for t in _QWEN3_EXTRA_PLAIN])
    tok.add_special_tokens([added(t, True) for t in fish_extra])
    tok.add_special_tokens([added(t, True) for t in SEMANTIC_TOKENS])
    return tok


def _s2_tokenizer_config_files(tok_json: dict, model_max_length: int) -> tuple[dict, dict]:
    decoder = {}
    for a in sorted(tok_json["added_tokens"], key=lambda a: a["id"]):
        decoder[str(a["id"])] = {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                                   "single_word", "special")}
    extra = S2_FISH_SPECIAL_TOKENS + SEMANTIC_TOKENS
    config = {
        "added_tokens_decoder": decoder,
        "additional_special_tokens": extra,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "extra_special_tokens": {},
        "model_max_length": model_max_length,
        "pad_token": "<|pad|>",
        "split_special_tokens": False,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    special_map = {
        "additional_special_tokens": extra,
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
    }
    return config, special_map


def _s2_config(*, vocab_size, ids, dim, n_layer, n_head, n_local_heads, head_dim, intermediate,
               fast_layers, fast_n_head, fast_n_local_heads, fast_head_dim, fast_intermediate,
               max_seq_len) -> dict:
    common = {
        "attention_o_bias": False,
        "attention_qkv_bias": False,
        "audio_hidden_dim": 128,
        "dropout": 0.0,
        "initializer_range": 0.02,
        "moe_intermediate_size": 768,
        "norm_eps": 1e-06,
        "norm_topk_prob": True,
        "num_experts": 1,
        "num_experts_per_tok": 1,
        "rope_base": 1000000,
        "router_gamma": 0.001,
        "use_aux_loss_free": False,
        "use_bfloat16": False,
        "use_gradient_checkpointing": True,
        "use_moe": False,
    }
    text = dict(common, **{
        "attention_qk_norm": True,
        "dim": dim,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "max_seq_len": max_seq_len,
        "model_type": "fish_qwen3",
        "n_head": n_head,
        "n_layer": n_layer,
        "n_local_heads": n_local_heads,
        "tie_word_embeddings": True,
        "vocab_size": vocab_size,
    })
    audio = dict(common, **{
        "attention_qk_norm": False,
        "dim": dim,
        "head_dim": fast_head_dim,
        "intermediate_size": fast_intermediate,
        "max_seq_len": NUM_CODEBOOKS + 1,
        "model_type": "fish_qwen3_audio_decoder",
        "n_head": fast_n_head,
        "n_layer": fast_layers,
        "n_local_heads": fast_n_local_heads,
        "num_codebooks": NUM_CODEBOOKS,
        "text_dim": dim,
        "tie_word_embeddings": False,
        "vocab_size": CODEBOOK_SIZE,
    })
    return {
        "audio_decoder_config": audio,
        "audio_pad_token_id": ids["<|audio_pad|>"],
        "dtype": "bfloat16",
        "eos_token_id": ids["<|im_end|>"],
        "model_type": "fish_qwen3_omni",
        "pad_token_id": ids["<|pad|>"],
        "semantic_end_token_id": ids[SEMANTIC_TOKENS[-1]],
        "semantic_start_token_id": ids[SEMANTIC_TOKENS[0]],
        "text_config": text,
    }


def write_tiny_s2_checkpoint(
    out_dir: Path,
    seed: int = 0,
    *,
    dim: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_local_heads: int = 2,
    head_dim: int = 32,
    intermediate: int = 128,
    fast_layers: int = 2,
    shards: int = 2,
    max_seq_len: int = 4096,
    fast_n_head: int | None = None,
    fast_n_local_heads: int | None = None,
    fast_head_dim: int | None = None,
    fast_intermediate: int | None = None,
    bpe_vocab_size: int = 768,
    with_codec: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write a tiny random S2-Pro-format checkpoint directory and return its path.

    Files: ``config.json``, ``tokenizer.json``, ``tokenizer_config.json``,
    ``special_tokens_map.json``, ``model-0000i-of-0000n.safetensors`` (bf16,
    S2 key names, tied head), ``model.safetensors.index.json``, and (unless
    ``with_codec=False``) ``codec.pth`` + ``codec_config.json``.

    The directory is built in a temp dir and renamed into place.  An existing
    empty ``out_dir`` is replaced; a non-empty one raises ``FileExistsError``
    unless ``overwrite=True``.
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    fast_n_head = fast_n_head or n_head
    fast_n_local_heads = fast_n_local_heads or n_local_heads
    fast_head_dim = fast_head_dim or head_dim
    fast_intermediate = fast_intermediate or intermediate

    tok = _train_s2_tokenizer(bpe_vocab_size)
    tok_text = tok.to_str(pretty=True)
    tok_json = json.loads(tok_text)
    ids = {a["content"]: a["id"] for a in tok_json["added_tokens"]}
    n_tokens = max(ids.values()) + 1
    vocab_size = _round_up(n_tokens, VOCAB_MULTIPLE)
    sem = [ids[t] for t in SEMANTIC_TOKENS]
    assert sem == list(range(sem[0], sem[0] + CODEBOOK_SIZE)), "semantic ids must be contiguous"

    shapes = _Shapes(
        vocab_size=vocab_size, dim=dim, n_layer=n_layer, n_head=n_head,
        n_local_heads=n_local_heads, head_dim=head_dim, intermediate=intermediate,
        qk_norm=True, untied_output=False, fast_dim=dim, n_fast_layer=fast_layers,
        fast_n_head=fast_n_head, fast_n_local_heads=fast_n_local_heads,
        fast_head_dim=fast_head_dim, fast_intermediate=fast_intermediate,
    )
    native = _native_state_dict(shapes, seed)
    disk = OrderedDict((s2_disk_key(k), v) for k, v in native.items())
    order = [k for k in disk if k.startswith("text_model.")] + [k for k in disk if k.startswith("audio_decoder.")]
    sizes = {k: disk[k].numel() * disk[k].element_size() for k in order}
    groups = _split_shards(order, sizes, shards)

    config = _s2_config(
        vocab_size=vocab_size, ids=ids, dim=dim, n_layer=n_layer, n_head=n_head,
        n_local_heads=n_local_heads, head_dim=head_dim, intermediate=intermediate,
        fast_layers=fast_layers, fast_n_head=fast_n_head, fast_n_local_heads=fast_n_local_heads,
        fast_head_dim=fast_head_dim, fast_intermediate=fast_intermediate, max_seq_len=max_seq_len,
    )
    tk_config, special_map = _s2_tokenizer_config_files(tok_json, model_max_length=32768)

    with _atomic_dir(out_dir, overwrite) as tmp:
        _write_text(tmp / "config.json", _json_text(config))
        _write_text(tmp / "tokenizer.json", tok_text)
        _write_text(tmp / "tokenizer_config.json", _json_text(tk_config, sort_keys=False))
        _write_text(tmp / "special_tokens_map.json", _json_text(special_map, sort_keys=False))
        weight_map: dict[str, str] = {}
        for i, group in enumerate(groups):
            fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
            save_file({k: disk[k] for k in group}, str(tmp / fname), metadata={"format": "pt"})
            weight_map.update({k: fname for k in group})
        index = {
            "metadata": {
                "total_parameters": sum(t.numel() for t in disk.values()),
                "total_size": sum(sizes.values()),
            },
            "weight_map": dict(sorted(weight_map.items())),
        }
        _write_text(tmp / "model.safetensors.index.json", _json_text(index))
        if with_codec:
            _write_codec(tmp, seed)
    return out_dir


# ---------------------------------------------------------------------------
# S1 tokenizer (tiktoken BPE)
# ---------------------------------------------------------------------------


def _gpt2_byte_order() -> list[int]:
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    return printable + [b for b in range(256) if b not in set(printable)]


def _train_s1_ranks(n_merges: int) -> dict[bytes, int]:
    """Byte-level BPE: most frequent pair wins, ties -> smallest (left, right) bytes.

    Rank of a merged token = 256 + merge index, so tiktoken's lowest-rank-first
    merging replays the training.  A merge whose bytes already exist as a token
    is applied to the words but takes no new rank.
    """
    import regex

    pattern = regex.compile(S1_TIKTOKEN_PATTERN)
    word_counts: Counter[bytes] = Counter()
    for line in demo_corpus():
        for m in pattern.finditer(line):  # not findall: the pattern has a group
            word_counts[m.group(0).encode("utf-8")] += 1

    ranks: dict[bytes, int] = {bytes([b]): r for r, b in enumerate(_gpt2_byte_order())}
    words = [([bytes([c]) for c in w], n) for w, n in sorted(word_counts.items())]
    next_rank = 256
    for _ in range(n_merges * 4):
        if next_rank >= 256 + n_merges:
            break
        pairs: Counter[tuple[bytes, bytes]] = Counter()
        for syms, n in words:
            for a, b in zip(syms, syms[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        best = min(pairs.items(), key=lambda kv: (-kv[1], kv[0]))
        (a, b), count = best
        if count < 2:
            break
        merged = a + b
        for syms, _n in words:
            j = 0
            while j < len(syms) - 1:
                if syms[j] == a and syms[j + 1] == b:
                    syms[j:j + 2] = [merged]
                j += 1
        if merged not in ranks:
            ranks[merged] = next_rank
            next_rank += 1
    return ranks


def _s1_config(*, vocab_size, dim, n_layer, n_head, n_local_heads, head_dim, intermediate,
               fast_layers, fast_n_head, fast_n_local_heads, fast_head_dim, fast_intermediate,
               max_seq_len) -> dict:
    return {
        "attention_o_bias": False,
        "attention_qk_norm": True,
        "attention_qkv_bias": False,
        "codebook_size": CODEBOOK_SIZE,
        "dim": dim,
        "dropout": 0.0,
        "fast_attention_o_bias": False,
        "fast_attention_qk_norm": False,
        "fast_attention_qkv_bias": False,
        "fast_dim": dim,
        "fast_head_dim": fast_head_dim,
        "fast_intermediate_size": fast_intermediate,
        "fast_n_head": fast_n_head,
        "fast_n_local_heads": fast_n_local_heads,
        "head_dim": head_dim,
        "initializer_range": 0.02,
        "intermediate_size": intermediate,
        "is_reward_model": False,
        "max_seq_len": max_seq_len,
        "model_type": "dual_ar",
        "n_fast_layer": fast_layers,
        "n_head": n_head,
        "n_layer": n_layer,
        "n_local_heads": n_local_heads,
        "norm_eps": 1e-06,
        "num_codebooks": NUM_CODEBOOKS,
        "rope_base": 1000000,
        "scale_codebook_embeddings": True,
        "tie_word_embeddings": False,
        "use_gradient_checkpointing": True,
        "vocab_size": vocab_size,
    }


def write_tiny_s1_checkpoint(
    out_dir: Path,
    seed: int = 0,
    *,
    dim: int = 64,
    n_layer: int = 2,
    n_head: int = 4,
    n_local_heads: int = 2,
    head_dim: int = 32,
    intermediate: int = 128,
    fast_layers: int = 2,
    max_seq_len: int = 4096,
    fast_n_head: int | None = None,
    fast_n_local_heads: int | None = None,
    fast_head_dim: int | None = None,
    fast_intermediate: int | None = None,
    n_merges: int = 512,
    with_codec: bool = True,
    overwrite: bool = False,
) -> Path:
    """Write a tiny random openaudio-s1-mini-format checkpoint directory.

    Files: ``config.json`` (flat ``dual_ar``, every ``DualARModelArgs`` field,
    sorted keys, indent 4), ``tokenizer.tiktoken``, ``special_tokens.json``,
    ``model.pth`` (plain bf16 state dict, native names, untied ``output.weight``
    whose padding rows are zero), plus ``codec.pth`` + ``codec_config.json``.
    Same atomic-write / overwrite rules as :func:`write_tiny_s2_checkpoint`.
    """
    out_dir = Path(out_dir)
    fast_n_head = fast_n_head or n_head
    fast_n_local_heads = fast_n_local_heads or n_local_heads
    fast_head_dim = fast_head_dim or head_dim
    fast_intermediate = fast_intermediate or intermediate
    if dim % n_head or dim % fast_n_head:
        raise ValueError("the S1 code asserts dim % n_head == 0 (slow and fast)")

    ranks = _train_s1_ranks(n_merges)
    specials = S1_SPECIAL_TOKENS + SEMANTIC_TOKENS
    special_ids = {t: len(ranks) + i for i, t in enumerate(specials)}
    n_tokens = len(ranks) + len(specials)
    vocab_size = _round_up(n_tokens, VOCAB_MULTIPLE)

    shapes = _Shapes(
        vocab_size=vocab_size, dim=dim, n_layer=n_layer, n_head=n_head,
        n_local_heads=n_local_heads, head_dim=head_dim, intermediate=intermediate,
        qk_norm=True, untied_output=True, fast_dim=dim, n_fast_layer=fast_layers,
        fast_n_head=fast_n_head, fast_n_local_heads=fast_n_local_heads,
        fast_head_dim=fast_head_dim, fast_intermediate=fast_intermediate,
    )
    state = _native_state_dict(shapes, seed, zero_rows_from=n_tokens)
    config = _s1_config(
        vocab_size=vocab_size, dim=dim, n_layer=n_layer, n_head=n_head,
        n_local_heads=n_local_heads, head_dim=head_dim, intermediate=intermediate,
        fast_layers=fast_layers, fast_n_head=fast_n_head, fast_n_local_heads=fast_n_local_heads,
        fast_head_dim=fast_head_dim, fast_intermediate=fast_intermediate, max_seq_len=max_seq_len,
    )
    tiktoken_text = "".join(
        f"{base64.b64encode(tok).decode('ascii') or '='} {rank}\n"
        for tok, rank in sorted(ranks.items(), key=lambda kv: kv[1])
    )

    with _atomic_dir(out_dir, overwrite) as tmp:
        _write_text(tmp / "config.json", _json_text(config, indent=4, newline=False))
        _write_text(tmp / "tokenizer.tiktoken", tiktoken_text)
        _write_text(tmp / "special_tokens.json",
                    json.dumps(special_ids, indent=2, ensure_ascii=False))
        torch.save(state, tmp / "model.pth")
        if with_codec:
            _write_codec(tmp, seed)
    return out_dir


# ---------------------------------------------------------------------------
# Built-in default model
# ---------------------------------------------------------------------------

_S2_REQUIRED_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json",
                      "special_tokens_map.json", "model.safetensors.index.json",
                      "codec.pth", "codec_config.json")


def _is_complete_s2(path: Path) -> bool:
    if not all((path / f).is_file() for f in _S2_REQUIRED_FILES):
        return False
    try:
        index = json.loads((path / "model.safetensors.index.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return all((path / f).is_file() for f in set(index.get("weight_map", {}).values()))


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    try:
        import fcntl
    except ImportError:  # not POSIX: rely on the atomic rename alone
        yield
        return
    with open(path, "a+b") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def default_cache_root() -> Path:
    """``$SHOAL_CACHE`` if set, else ``~/.cache/shoal``."""
    env = os.environ.get("SHOAL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "shoal"


def default_checkpoint(cache_dir: Path | None = None) -> Path:
    """Path of shoal's built-in demo checkpoint, generating it on first use.

    ``<cache_dir or $SHOAL_CACHE or ~/.cache/shoal>/default-s2-tiny-v1`` holds
    a tiny random S2-format model (``write_tiny_s2_checkpoint(seed=2026)``).
    It makes the whole pipeline runnable without downloads; its audio is noise,
    not speech.  Concurrent first calls are serialised by a lock file, and the
    directory only ever appears complete (atomic rename).
    """
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_root()
    target = root / DEFAULT_CHECKPOINT_NAME
    if _is_complete_s2(target):
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _file_lock(root / f".{DEFAULT_CHECKPOINT_NAME}.lock"):
        if _is_complete_s2(target):
            return target
        print(f"shoal: generating the built-in demo model (random weights, not speech) in {target}",
              file=sys.stderr, flush=True)
        try:
            # An incomplete leftover (e.g. files deleted by hand) is replaced.
            write_tiny_s2_checkpoint(target, seed=DEFAULT_SEED, overwrite=target.exists())
        except FileExistsError:
            if not _is_complete_s2(target):  # another process without a lock won the race
                raise
    return target
