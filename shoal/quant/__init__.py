"""Block-scaled FP8 quantization: checkpoint conversion, verified loading, CPU model path, gate.

See docs/quantization.md.
"""

from .convert import (
                      FORMAT,
                      SCALE_LAYOUT,
                      VERSION,
                      is_quantizable,
                      quantize_checkpoint,
                      quantize_model,
                      quantize_state_dict,
)
from .fp8 import (
                      BLOCK,
                      FP8_MAX,
                      FP8Linear,
                      dequantize_weight_block,
                      fake_quantize_act,
                      fingerprint,
                      quantize_weight_block,
                      scale_shape,
)
from .loader import (
                      is_fp8_checkpoint,
                      load_fp8_dualar,
                      load_fp8_model,
                      read_fp8_state_dict,
                      read_fp8_tensors,
)

__all__ = [
                      "BLOCK",
                      "FORMAT",
                      "FP8_MAX",
                      "SCALE_LAYOUT",
                      "VERSION",
                      "FP8Linear",
                      "dequantize_weight_block",
                      "fake_quantize_act",
                      "fingerprint",
                      "is_fp8_checkpoint",
                      "is_quantizable",
                      "load_fp8_dualar",
                      "load_fp8_model",
                      "quantize_checkpoint",
                      "quantize_model",
                      "quantize_state_dict",
                      "quantize_weight_block",
                      "read_fp8_state_dict",
                      "read_fp8_tensors",
                      "scale_shape",
]
