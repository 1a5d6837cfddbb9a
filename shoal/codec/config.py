"""Hyper-parameters of the modded-DAC codec (fish-speech ``modded_dac_vq``).

``CodecConfig.real()`` is the codec shipped with S1-mini and S2-Pro.  A
``codec_config.json`` beside ``codec.pth`` (the flattened format of
``golden/codec_tiny/config.json``) overrides it; see :func:`config_for_checkpoint`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "TransformerConfig",
    "QuantizerConfig",
    "CodecConfig",
    "config_for_checkpoint",
]


@dataclass(frozen=True)
class TransformerConfig:
    """A window-limited causal transformer (pre-norm, RoPE, SwiGLU, LayerScale)."""

    dim: int
    n_layer: int
    n_head: int
    head_dim: int
    intermediate_size: int
    window_size: int
    rope_base: float = 10000.0
    norm_eps: float = 1e-5
    n_local_heads: int = -1
    causal: bool = True

    def __post_init__(self) -> None:
        if self.n_local_heads == -1:
            object.__setattr__(self, "n_local_heads", self.n_head)
        if self.n_local_heads != self.n_head:
            # The reference splits wqkv into three equal parts, so it only works
            # with n_local_heads == n_head; every released codec uses that.
            raise ValueError(
                f"codec transformer needs n_local_heads == n_head, got {self.n_local_heads} != {self.n_head}"
            )
        if not self.causal:
            raise ValueError("only the causal codec transformer is supported")
        if self.n_head <= 0 or self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"bad transformer head layout: n_head={self.n_head} head_dim={self.head_dim}")
        if self.window_size <= 0:
            raise ValueError("window_size must be positive")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TransformerConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class QuantizerConfig:
    """``DownsampleResidualVectorQuantize``: downsample, pre/post transformers, 1 + N VQs."""

    input_dim: int
    pre_module: TransformerConfig
    post_module: TransformerConfig
    downsample_factor: tuple[int, ...] = (2, 2)
    downsample_dims: tuple[int, ...] | None = None
    semantic_codebook_size: int = 4096
    n_semantic_codebooks: int = 1
    codebook_size: int = 1024
    n_codebooks: int = 9
    codebook_dim: int = 8
    convnext_mlp_ratio: float = 4.0
    convnext_kernel_size: int = 7
    convnext_layernorm_eps: float = 1e-6

    def __post_init__(self) -> None:
        object.__setattr__(self, "downsample_factor", tuple(int(f) for f in self.downsample_factor))
        dims = self.downsample_dims
        if dims is None:
            dims = tuple(self.input_dim for _ in self.downsample_factor)
        object.__setattr__(self, "downsample_dims", tuple(int(d) for d in dims))
        if len(self.downsample_dims) != len(self.downsample_factor):
            raise ValueError("downsample_dims and downsample_factor differ in length")
        if self.n_semantic_codebooks != 1:
            raise ValueError("the modded-DAC quantizer has exactly one semantic codebook")
        if self.pre_module.dim != self.downsample_dims[-1] or self.post_module.dim != self.downsample_dims[-1]:
            # input_proj/output_proj are Identity only when the dims agree; the
            # reference checkpoints never carry those projections.
            raise ValueError("pre/post transformer dim must equal the last downsample dim")

    @property
    def all_dims(self) -> tuple[int, ...]:
        return (self.input_dim,) + tuple(self.downsample_dims)

    @property
    def downsample_total(self) -> int:
        return math.prod(self.downsample_factor)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "QuantizerConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["pre_module"] = TransformerConfig.from_dict(d["pre_module"])
        kw["post_module"] = TransformerConfig.from_dict(d["post_module"])
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["downsample_factor"] = list(self.downsample_factor)
        d["downsample_dims"] = list(self.downsample_dims)
        return d


@dataclass(frozen=True)
class CodecConfig:
    """All hyper-parameters of the codec.

    ``encoder_transformer`` describes the encoder transformer; the reference
    builds, for every encoder block ``i`` with ``encoder_transformer_layers[i] > 0``,
    a transformer of dim = block dim, ``n_head = dim // 64``, FFN ``3 * dim`` and
    the head_dim / window / rope_base / norm_eps of this template (see
    :meth:`encoder_block_transformer`).  ``decoder_transformer_layers`` is kept
    for round-tripping only: the reference builds that module but never uses it
    (it has no weights).
    """

    encoder_dim: int
    latent_dim: int
    decoder_dim: int
    quantizer: QuantizerConfig
    encoder_transformer: TransformerConfig
    sample_rate: int = 44100
    causal: bool = True
    encoder_rates: tuple[int, ...] = (2, 4, 8, 8)
    decoder_rates: tuple[int, ...] = (8, 8, 4, 2)
    encoder_transformer_layers: tuple[int, ...] = (0, 0, 0, 0)
    decoder_transformer_layers: tuple[int, ...] = (0, 0, 0, 0)

    def __post_init__(self) -> None:
        for name in ("encoder_rates", "decoder_rates", "encoder_transformer_layers", "decoder_transformer_layers"):
            object.__setattr__(self, name, tuple(int(x) for x in getattr(self, name)))
        if not self.causal:
            raise ValueError("only the causal modded-DAC codec is supported")
        if len(self.encoder_transformer_layers) != len(self.encoder_rates):
            raise ValueError("encoder_transformer_layers must have one entry per encoder rate")
        if self.quantizer.input_dim != self.latent_dim:
            raise ValueError("quantizer.input_dim must equal latent_dim")
        if math.prod(self.encoder_rates) != math.prod(self.decoder_rates):
            raise ValueError("encoder and decoder total strides differ")
        if self.decoder_dim % (2 ** len(self.decoder_rates)):
            raise ValueError("decoder_dim must be divisible by 2**len(decoder_rates)")
        for i in range(len(self.encoder_rates)):
            self.encoder_block_transformer(i)  # validates head counts

    # ------------------------------------------------------------------ derived
    @property
    def hop_length_encoder(self) -> int:
        return math.prod(self.encoder_rates)

    @property
    def frame_length(self) -> int:
        return self.hop_length_encoder * self.quantizer.downsample_total

    @property
    def num_codebooks(self) -> int:
        return self.quantizer.n_semantic_codebooks + self.quantizer.n_codebooks

    @property
    def codebook_sizes(self) -> tuple[int, ...]:
        q = self.quantizer
        return (q.semantic_codebook_size,) + (q.codebook_size,) * q.n_codebooks

    @property
    def encoder_block_dims(self) -> tuple[int, ...]:
        return tuple(self.encoder_dim * 2 ** (i + 1) for i in range(len(self.encoder_rates)))

    @property
    def decoder_block_channels(self) -> tuple[tuple[int, int], ...]:
        c = self.decoder_dim
        return tuple((c // 2**i, c // 2 ** (i + 1)) for i in range(len(self.decoder_rates)))

    def encoder_block_transformer(self, i: int) -> TransformerConfig | None:
        n = self.encoder_transformer_layers[i]
        if n == 0:
            return None
        d = self.encoder_block_dims[i]
        if d // 64 == 0:
            raise ValueError(f"encoder block {i} has dim {d} < 64 but a transformer")
        return dataclasses.replace(
            self.encoder_transformer,
            dim=d,
            n_layer=n,
            n_head=d // 64,
            n_local_heads=d // 64,
            intermediate_size=3 * d,
        )

    # ------------------------------------------------------------ constructors
    @classmethod
    def real(cls) -> "CodecConfig":
        """The ``modded_dac_vq`` codec of openaudio-s1-mini and S2-Pro."""
        pre_post = TransformerConfig(
            dim=1024, n_layer=8, n_head=16, head_dim=64, intermediate_size=3072,
            window_size=128, rope_base=10000.0, norm_eps=1e-5,
        )
        return cls(
            sample_rate=44100,
            causal=True,
            encoder_dim=64,
            encoder_rates=(2, 4, 8, 8),
            latent_dim=1024,
            decoder_dim=1536,
            decoder_rates=(8, 8, 4, 2),
            encoder_transformer_layers=(0, 0, 0, 4),
            decoder_transformer_layers=(4, 0, 0, 0),
            encoder_transformer=TransformerConfig(
                dim=1024, n_layer=4, n_head=16, head_dim=64, intermediate_size=3072,
                window_size=512, rope_base=10000.0, norm_eps=1e-5,
            ),
            quantizer=QuantizerConfig(
                input_dim=1024,
                downsample_factor=(2, 2),
                downsample_dims=(1024, 1024),
                semantic_codebook_size=4096,
                n_semantic_codebooks=1,
                codebook_size=1024,
                n_codebooks=9,
                codebook_dim=8,
                pre_module=pre_post,
                post_module=pre_post,
            ),
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "CodecConfig":
        try:
            enc_layers = tuple(d.get("encoder_transformer_layers", (0, 0, 0, 0)))
            enc_t = d.get("encoder_transformer")
            if enc_t is None:
                enc_t_cfg = TransformerConfig(
                    dim=64, n_layer=1, n_head=1, head_dim=64, intermediate_size=192, window_size=512
                )
            else:
                enc_t_cfg = TransformerConfig.from_dict(enc_t)
            cfg = cls(
                sample_rate=int(d.get("sample_rate", 44100)),
                causal=bool(d.get("causal", True)),
                encoder_dim=int(d["encoder_dim"]),
                encoder_rates=tuple(d.get("encoder_rates", (2, 4, 8, 8))),
                latent_dim=int(d.get("latent_dim") or d["encoder_dim"] * 2 ** len(d.get("encoder_rates", (2, 4, 8, 8)))),
                decoder_dim=int(d["decoder_dim"]),
                decoder_rates=tuple(d.get("decoder_rates", (8, 8, 4, 2))),
                encoder_transformer_layers=enc_layers,
                decoder_transformer_layers=tuple(d.get("decoder_transformer_layers", (0, 0, 0, 0))),
                encoder_transformer=enc_t_cfg,
                quantizer=QuantizerConfig.from_dict(d["quantizer"]),
            )
        except KeyError as e:
            raise ValueError(f"codec config is missing field {e.args[0]!r}") from None
        # Cross-check the explicit encoder transformer against the reference rule.
        if enc_t is not None:
            for i in range(len(cfg.encoder_rates)):
                derived = cfg.encoder_block_transformer(i)
                if derived is not None and derived.dim == enc_t_cfg.dim and derived != enc_t_cfg:
                    raise ValueError(
                        f"codec config encoder_transformer {enc_t_cfg} disagrees with the reference "
                        f"rule for block {i}: {derived}"
                    )
        # Cross-check other derived fields if the file carries them.
        for key, val in (("frame_length", cfg.frame_length), ("hop_length_encoder", cfg.hop_length_encoder)):
            if key in d and int(d[key]) != val:
                raise ValueError(f"codec config {key}={d[key]} but the rates give {val}")
        return cfg

    @classmethod
    def from_json(cls, path: str | Path) -> "CodecConfig":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise FileNotFoundError(f"codec config not found: {path}") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        try:
            return cls.from_dict(data)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{path}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The flattened ``config.json`` format of ``golden/codec_tiny``."""
        enc_t = None
        for i in range(len(self.encoder_rates)):
            t = self.encoder_block_transformer(i)
            if t is not None:
                enc_t = t
        return {
            "format": "fish-speech modded DAC (fish_speech.models.dac.modded_dac.DAC + rvq.DownsampleResidualVectorQuantize)",
            "sample_rate": self.sample_rate,
            "causal": self.causal,
            "encoder_dim": self.encoder_dim,
            "encoder_rates": list(self.encoder_rates),
            "latent_dim": self.latent_dim,
            "encoder_block_dims": list(self.encoder_block_dims),
            "encoder_transformer_layers": list(self.encoder_transformer_layers),
            "encoder_transformer": (enc_t or self.encoder_transformer).to_dict(),
            "decoder_dim": self.decoder_dim,
            "decoder_rates": list(self.decoder_rates),
            "decoder_block_channels": [list(c) for c in self.decoder_block_channels],
            "decoder_transformer_layers": list(self.decoder_transformer_layers),
            "hop_length_encoder": self.hop_length_encoder,
            "frame_length": self.frame_length,
            "quantizer": self.quantizer.to_dict(),
        }

    def to_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")


def config_for_checkpoint(codec_path: str | Path) -> CodecConfig:
    """The shoal convention: ``codec_config.json`` beside ``codec.pth`` wins, else the real config."""
    p = Path(codec_path)
    cfg_path = (p if p.is_dir() else p.parent) / "codec_config.json"
    if cfg_path.is_file():
        return CodecConfig.from_json(cfg_path)
    return CodecConfig.real()
