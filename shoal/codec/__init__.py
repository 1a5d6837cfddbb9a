"""The modded-DAC audio codec of Fish Speech S1-mini / S2-Pro (encode, decode, streaming decode).

Typical use::

    codec = load_codec("checkpoints/s2-pro/codec.pth", device="cuda")
    codes, code_lengths = codec.encode(audio_b1n)       # [B, 10, T] int64
    audio = codec.decode(codes)                         # [B, 1, 2048 T]

    dec = StreamingDecoder(codec)
    state = dec.new_state(batch_size)
    chunk = dec.decode_chunk(codes[:, :, i:i + t], state)

See docs/codec.md.
"""

from .audio import AudioDecodeError, decode_to_wav, encode_file, load_audio, resample, to_int16, write_wav
from .config import CodecConfig, QuantizerConfig, TransformerConfig, config_for_checkpoint
from .loader import CodecFileNotFoundError, CodecLoadError, load_codec
from .model import Codec
from .random_init import write_random_codec
from .streaming import DecoderState, GraphedStreamingDecoder, StreamingDecoder, serving_decoder

__all__ = [
    "Codec",
    "CodecConfig",
    "QuantizerConfig",
    "TransformerConfig",
    "config_for_checkpoint",
    "CodecLoadError",
    "CodecFileNotFoundError",
    "load_codec",
    "DecoderState",
    "StreamingDecoder",
    "GraphedStreamingDecoder",
    "serving_decoder",
    "write_random_codec",
    "AudioDecodeError",
    "load_audio",
    "resample",
    "to_int16",
    "write_wav",
    "encode_file",
    "decode_to_wav",
]
