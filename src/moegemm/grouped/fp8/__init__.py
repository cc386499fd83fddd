"""FP8 e4m3 grouped GEMMs with DeepSeek-V3's block scales (one per token and 128 channels for activations,
one per 128 x 128 block for weights): the contiguous and masked layouts, the gate/up projection with SwiGLU
and the down projection's quantisation fused, and the quantisation helpers."""

from .api import grouped_mm_fp8, grouped_mm_fp8_masked, grouped_mm_fp8_swiglu
from .config import Fp8Config
from .ffn import moe_ffn_fp8
from .quant import (
    dequantize_fp8_rows,
    dequantize_fp8_weights,
    quantize_fp8_rows,
    quantize_fp8_weights,
)

__all__ = [
    "Fp8Config",
    "dequantize_fp8_rows",
    "dequantize_fp8_weights",
    "grouped_mm_fp8",
    "grouped_mm_fp8_masked",
    "grouped_mm_fp8_swiglu",
    "moe_ffn_fp8",
    "quantize_fp8_rows",
    "quantize_fp8_weights",
]
