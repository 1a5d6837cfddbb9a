"""Model configuration: one typed object for both published DualAR families.

S2-Pro ships a nested ``fish_qwen3_omni`` config.json; openaudio-s1-mini ships a flat
``dual_ar`` one. Both are flattened here into :class:`ModelConfig`, which also records the
*family* (``"s2"`` or ``"s1"``): the family selects the prompt layout, the fast-transformer
input (final-normed for S2, pre-norm for S1) and the sampling rules.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A config.json that cannot describe a supported DualAR model."""


def _round_up(x: int, multiple: int) -> int:
    return (x + multiple - 1) // multiple * multiple


@dataclass(frozen=True)
class TransformerShape:
    """Hyper-parameters of one transformer stack (slow or fast)."""

    dim: int
    n_layer: int
    n_head: int
    n_local_heads: int
    head_dim: int
    intermediate_size: int
    qk_norm: bool = False
    qkv_bias: bool = False
    o_bias: bool = False

    @property
    def q_size(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.n_local_heads * self.head_dim


@dataclass(frozen=True)
class ModelConfig:
    family: str  # "s2" (fish_qwen3_omni) or "s1" (dual_ar)
    vocab_size: int
    slow: TransformerShape
    fast: TransformerShape
    num_codebooks: int = 10
    codebook_size: int = 4096
    max_seq_len: int = 32768
    rope_base: float = 1e6
    norm_eps: float = 1e-6
    tie_word_embeddings: bool = True
    scale_codebook_embeddings: bool = True
    norm_fastlayer_input: bool = True
    semantic_begin_id: int | None = None  # from config or tokenizer
    semantic_end_id: int | None = None
    eos_token_id: int | None = None
    source: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def with_semantic_ids(self, begin: int, end: int) -> "ModelConfig":
        return replace(self, semantic_begin_id=begin, semantic_end_id=end)

    def with_max_seq_len(self, max_seq_len: int) -> "ModelConfig":
        return replace(self, max_seq_len=max_seq_len)

    @property
    def residual_codebook_size(self) -> int:
        """Entries actually used by codebooks 1..9 (the codec's residual VQs: 1024; fewer only
        in test models whose whole codebook is smaller)."""
        return min(1024, self.codebook_size)

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"{path}: config.json not found")
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(data, where=str(path))

    @classmethod
    def from_dict(cls, data: dict[str, Any], where: str = "config.json") -> "ModelConfig":
        model_type = data.get("model_type")
        if model_type == "fish_qwen3_omni":
            return cls._from_s2(data, where)
        if model_type == "dual_ar":
            return cls._from_s1(data, where)
        raise ConfigError(
            f"{where}: unsupported model_type {model_type!r}; expected 'fish_qwen3_omni' "
            "(S2-Pro) or 'dual_ar' (openaudio-s1-mini)"
        )

    @staticmethod
    def _need(d: dict[str, Any], key: str, where: str) -> Any:
        if key not in d:
            raise ConfigError(f"{where}: missing required field {key!r}")
        return d[key]

    @classmethod
    def _shape(cls, d: dict[str, Any], where: str, prefix: str = "", fallback: dict | None = None,
               qk_default: bool = False) -> TransformerShape:
        fb = fallback or {}

        def get(name: str, default: Any = None) -> Any:
            key = prefix + name
            if key in d and d[key] is not None:
                return d[key]
            if name in fb:
                return fb[name]
            if default is not None:
                return default
            raise ConfigError(f"{where}: missing required field {key!r}")

        dim = int(get("dim"))
        n_head = int(get("n_head"))
        n_local = get("n_local_heads", -1)
        n_local = n_head if n_local in (-1, None) else int(n_local)
        head_dim = get("head_dim", dim // n_head)
        inter = d.get(prefix + "intermediate_size") or fb.get("intermediate_size")
        if inter is None:
            inter = _round_up(int(2 * 4 * dim / 3), 256)
        n_layer = int(get("n_layer")) if not prefix else int(d.get("n_fast_layer", fb.get("n_layer", 4)))
        if n_head % n_local:
            raise ConfigError(f"{where}: n_head {n_head} is not a multiple of n_local_heads {n_local}")
        return TransformerShape(
            dim=dim,
            n_layer=n_layer,
            n_head=n_head,
            n_local_heads=n_local,
            head_dim=int(head_dim),
            intermediate_size=int(inter),
            qk_norm=bool(d.get(prefix + "attention_qk_norm", fb.get("qk_norm", qk_default))),
            qkv_bias=bool(d.get(prefix + "attention_qkv_bias", fb.get("qkv_bias", False))),
            o_bias=bool(d.get(prefix + "attention_o_bias", fb.get("o_bias", False))),
        )

    @classmethod
    def _from_s2(cls, data: dict[str, Any], where: str) -> "ModelConfig":
        text = cls._need(data, "text_config", where)
        adc = cls._need(data, "audio_decoder_config", where)
        slow = cls._shape(text, where + ":text_config")
        fast = TransformerShape(
            dim=int(cls._need(adc, "dim", where)),
            n_layer=int(cls._need(adc, "n_layer", where)),
            n_head=int(cls._need(adc, "n_head", where)),
            n_local_heads=int(adc.get("n_local_heads") or adc["n_head"]),
            head_dim=int(adc.get("head_dim") or adc["dim"] // adc["n_head"]),
            intermediate_size=int(adc.get("intermediate_size")
                                  or _round_up(int(2 * 4 * adc["dim"] / 3), 256)),
            qk_norm=bool(adc.get("attention_qk_norm", False)),
            qkv_bias=bool(adc.get("attention_qkv_bias", False)),
            o_bias=bool(adc.get("attention_o_bias", False)),
        )
        if fast.dim != slow.dim:
            raise ConfigError(
                f"{where}: fast dim {fast.dim} != slow dim {slow.dim}; a fast_project_in layer "
                "is not used by any released model and is not supported"
            )
        return cls(
            family="s2",
            vocab_size=int(cls._need(text, "vocab_size", where)),
            slow=slow,
            fast=fast,
            num_codebooks=int(adc.get("num_codebooks", 10)),
            codebook_size=int(adc.get("vocab_size", 4096)),
            max_seq_len=int(text.get("max_seq_len", 32768)),
            rope_base=float(text.get("rope_base", 1e6)),
            norm_eps=float(text.get("norm_eps", 1e-6)),
            tie_word_embeddings=bool(text.get("tie_word_embeddings", True)),
            scale_codebook_embeddings=True,  # forced by the reference loader for S2
            norm_fastlayer_input=True,  # forced by the reference loader for S2
            semantic_begin_id=data.get("semantic_start_token_id"),
            semantic_end_id=data.get("semantic_end_token_id"),
            eos_token_id=data.get("eos_token_id"),
            source=data,
        )

    @classmethod
    def _from_s1(cls, data: dict[str, Any], where: str) -> "ModelConfig":
        slow = cls._shape(data, where)
        fast = cls._shape(
            data, where, prefix="fast_",
            fallback={"dim": slow.dim, "n_head": slow.n_head, "n_local_heads": slow.n_local_heads,
                      "head_dim": slow.head_dim, "intermediate_size": slow.intermediate_size,
                      "qk_norm": slow.qk_norm, "qkv_bias": slow.qkv_bias, "o_bias": slow.o_bias},
        )
        if fast.dim != slow.dim:
            raise ConfigError(f"{where}: fast_dim {fast.dim} != dim {slow.dim} is not supported")
        num_codebooks = int(data.get("num_codebooks", 4))
        if num_codebooks != 10 or int(data.get("codebook_size", 160)) != 4096:
            raise ConfigError(
                f"{where}: this dual_ar checkpoint has {num_codebooks} codebooks of "
                f"{data.get('codebook_size')}; shoal supports the modded-DAC family "
                "(10 x 4096: openaudio-s1-mini, S2-Pro), not fish-speech 1.x (FireflyGAN)"
            )
        return cls(
            family="s1",
            vocab_size=int(cls._need(data, "vocab_size", where)),
            slow=slow,
            fast=fast,
            num_codebooks=num_codebooks,
            codebook_size=int(data["codebook_size"]),
            max_seq_len=int(data.get("max_seq_len", 2048)),
            rope_base=float(data.get("rope_base", 10000)),
            norm_eps=float(data.get("norm_eps", 1e-5)),
            tie_word_embeddings=bool(data.get("tie_word_embeddings", True)),
            scale_codebook_embeddings=bool(data.get("scale_codebook_embeddings", False)),
            norm_fastlayer_input=bool(data.get("norm_fastlayer_input", False)),
            source=data,
        )

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Native parameter names -> shapes (after the S2 key remap)."""
        s, f = self.slow, self.fast
        shapes: dict[str, tuple[int, ...]] = {
            "embeddings.weight": (self.vocab_size, s.dim),
            "codebook_embeddings.weight": (self.num_codebooks * self.codebook_size, s.dim),
            "norm.weight": (s.dim,),
            "fast_embeddings.weight": (self.codebook_size, f.dim),
            "fast_norm.weight": (f.dim,),
            "fast_output.weight": (self.codebook_size, f.dim),
        }
        if not self.tie_word_embeddings:
            shapes["output.weight"] = (self.vocab_size, s.dim)
        for prefix, shape in (("layers", s), ("fast_layers", f)):
            for i in range(shape.n_layer):
                p = f"{prefix}.{i}."
                shapes[p + "attention.wqkv.weight"] = (shape.q_size + 2 * shape.kv_size, shape.dim)
                shapes[p + "attention.wo.weight"] = (shape.dim, shape.q_size)
                if shape.qkv_bias:
                    shapes[p + "attention.wqkv.bias"] = (shape.q_size + 2 * shape.kv_size,)
                if shape.o_bias:
                    shapes[p + "attention.wo.bias"] = (shape.dim,)
                if shape.qk_norm:
                    shapes[p + "attention.q_norm.weight"] = (shape.head_dim,)
                    shapes[p + "attention.k_norm.weight"] = (shape.head_dim,)
                shapes[p + "attention_norm.weight"] = (shape.dim,)
                shapes[p + "ffn_norm.weight"] = (shape.dim,)
                shapes[p + "feed_forward.w1.weight"] = (shape.intermediate_size, shape.dim)
                shapes[p + "feed_forward.w3.weight"] = (shape.intermediate_size, shape.dim)
                shapes[p + "feed_forward.w2.weight"] = (shape.dim, shape.intermediate_size)
        return shapes
