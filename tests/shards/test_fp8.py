from __future__ import annotations

import torch

from dflash_queue.shards.fp8 import FP8_MAX, dequantize_fp8, quantize_fp8


def outlier_states(tokens: int = 64, layers: int = 3, hidden: int = 512, seed: int = 0) -> torch.Tensor:
    """Gaussian states with trained-model quirks: a few massive channels, some huge tokens, an all-zero vector."""
    gen = torch.Generator().manual_seed(seed)
    states = torch.randn(tokens, layers, hidden, generator=gen)
    states[:, :, 7] *= 300.0  # a massive-activation channel
    states[5] *= 1e4  # an outlier token
    states[9] *= 1e-4  # a tiny one
    states[11, 1] = 0.0
    return states


def test_quantisation_layout_and_scales():
    states = outlier_states()
    quantized, scales = quantize_fp8(states)
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == states.shape
    assert scales.dtype == torch.float32 and scales.shape == states.shape[:2]
    # Each token-and-layer vector is scaled so that its largest value is e4m3's largest.
    assert torch.equal(quantized.float().abs().amax(-1)[scales != 1], torch.full_like(scales[scales != 1], FP8_MAX))
    assert scales[11, 1] == 1 and not quantized[11, 1].float().any()


def test_relative_error_is_bounded_per_element_and_per_vector():
    states = outlier_states()
    restored = dequantize_fp8(*quantize_fp8(states), torch.float32)
    assert torch.isfinite(restored).all()
    amax = states.abs().amax(-1, keepdim=True)
    # e4m3 keeps 3 mantissa bits: relative rounding error at most 2**-4 for every element in its normal range
    # (above amax / 448 * 2**-6); below it the absolute error is at most half the subnormal step.
    normal = states.abs() >= amax / FP8_MAX * 2**-6
    relative = (restored - states).abs() / states.abs().clamp_min(1e-30)
    assert relative[normal].max() <= 2**-4
    assert ((restored - states).abs()[~normal] <= (amax / FP8_MAX * 2**-10).expand_as(states)[~normal]).all()
    per_vector = (restored - states).norm(dim=-1) / states.norm(dim=-1).clamp_min(1e-30)
    assert per_vector.max() <= 2**-4 and per_vector[states.norm(dim=-1) > 0].mean() < 0.035


def test_dequantise_to_the_dtype_asked():
    quantized, scales = quantize_fp8(outlier_states(tokens=16))
    as_bf16 = dequantize_fp8(quantized, scales, torch.bfloat16)
    as_f32 = dequantize_fp8(quantized, scales, torch.float32)
    assert as_bf16.dtype == torch.bfloat16 and as_f32.dtype == torch.float32
    assert torch.equal(as_bf16, as_f32.to(torch.bfloat16))


def test_dequantisation_is_exact_for_every_e4m3_code():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).reshape(2, 1, 128)
    scales = torch.tensor([[1.0], [3.0e-5]])
    want = codes.to(torch.float32) * scales.unsqueeze(-1)
    got = dequantize_fp8(codes, scales, torch.float32)
    finite = ~torch.isnan(want)
    assert finite.sum() == 254 and torch.equal(got[finite], want[finite])
