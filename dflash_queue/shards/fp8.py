"""FP8 (e4m3) storage of hidden states with one fp32 scale per token and layer.

Each vector hidden_states[t, k] (H values) is divided by its own scale, amax / 448, so that its largest value
lands on e4m3's largest finite value; e4m3 then keeps 3 mantissa bits for every element whatever its magnitude
(relative rounding error at most 2**-4). Per-token scales follow the outlier tokens that hidden states of
trained models have, which one scale per tensor would let crush every other token.

    hidden_states[t, k] ~= fp8[t, k].float() * hidden_scales[t, k]
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448.0
FP8_NAME = "fp8_e4m3"
SCALES_TENSOR = "hidden_scales"


def quantize_fp8(hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, K, H] floats -> (float8_e4m3fn [T, K, H], float32 scales [T, K])."""
    values = hidden.to(torch.float32)
    amax = values.abs().amax(dim=-1)
    # An all-zero vector gets scale 1 (it quantises to zeros either way); no division by zero.
    scales = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (values / scales.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized, scales


def dequantize_fp8(quantized: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """The inverse of `quantize_fp8`, in `dtype` (computed in float32, then cast once)."""
    if quantized.device.type != "cpu":
        return (quantized.to(torch.float32) * scales.to(torch.float32).unsqueeze(-1)).to(dtype)
    # On the CPU, torch converts e4m3 element by element; moving the bits into a float16 is exact and vectorised.
    # e4m3 (bias 7) S.EEEE.MMM -> float16 (bias 15) S.0EEEE.MMM0000000: the same value times 2**-8, subnormals
    # included, so the scale absorbs the factor. (The e4m3 NaN code, never written, would read as +-480.)
    code = quantized.view(torch.uint8).to(torch.int16)
    bits = (code & 0x7F).bitwise_left_shift_(7).bitwise_or_((code & 0x80).bitwise_left_shift_(8))
    out = bits.view(torch.float16).to(torch.float32)
    out.mul_((scales.to(torch.float32) * 256.0).unsqueeze(-1))
    return out.to(dtype)
