"""Packed attention against Transformers' own eager attention of each model, one sequence at a time, with the
query blocks small enough that long sequences cross several of them."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward as gemma2_eager
from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward as gpt_oss_eager

from dflash_queue.engines.hf import packed_attention as packed
from dflash_queue.engines.hf.packed_attention import packed_attention, segment_sequences

HEADS, KV_HEADS, DIM = 4, 2, 16
LENGTHS = [37, 5, 64, 1, 23]


class Layer(nn.Module):
    num_key_value_groups = HEADS // KV_HEADS
    head_dim = DIM

    def __init__(self) -> None:
        super().__init__()
        self.sinks = nn.Parameter(torch.randn(HEADS, generator=torch.Generator().manual_seed(3)) * 3)


def qkv(total: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, HEADS, total, DIM, generator=generator) * 2,
        torch.randn(1, KV_HEADS, total, DIM, generator=generator) * 2,
        torch.randn(1, KV_HEADS, total, DIM, generator=generator),
    )


def additive_mask(length: int, window: int | None) -> torch.Tensor:
    """Transformers' causal (and sliding-window: kv > q - window) mask, as eager attention adds it."""
    q = torch.arange(length)[:, None]
    k = torch.arange(length)[None, :]
    visible = k <= q
    if window:
        visible &= k > q - window
    return torch.zeros(length, length).masked_fill(~visible, torch.finfo(torch.float32).min)[None, None]


@pytest.fixture(autouse=True)
def small_query_blocks(monkeypatch):
    monkeypatch.setattr(packed, "QUERY_BLOCK", 8)


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_window_and_softcap_equal_gemma2_eager_per_sequence(window, softcap):
    layer = Layer()
    query, key, value = qkv(sum(LENGTHS))
    bounds = [0]
    for n in LENGTHS:
        bounds.append(bounds[-1] + n)
    got, _ = packed_attention(
        layer, query, key, value, None, scaling=0.25, packed_bounds=bounds, sliding_window=window, softcap=softcap
    )
    for start, end in zip(bounds[:-1], bounds[1:]):
        want, _ = gemma2_eager(
            layer, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
            additive_mask(end - start, window), scaling=0.25, softcap=softcap,
        )
        torch.testing.assert_close(got[:, start:end], want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [None, 6])
def test_sinks_equal_gpt_oss_eager_per_sequence(window):
    layer = Layer()
    query, key, value = qkv(sum(LENGTHS), seed=1)
    bounds = [0, 37, 42, 106, 107, 130]
    got, _ = packed_attention(
        layer, query, key, value, None, scaling=0.25, packed_bounds=bounds, sliding_window=window, s_aux=layer.sinks
    )
    for start, end in zip(bounds[:-1], bounds[1:]):
        want, _ = gpt_oss_eager(
            layer, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end],
            additive_mask(end - start, window), scaling=0.25,
        )
        torch.testing.assert_close(got[:, start:end], want, rtol=1e-5, atol=1e-5)


def test_a_window_longer_than_the_sequence_is_plain_causal_attention():
    layer = Layer()
    query, key, value = qkv(30, seed=2)
    windowed, _ = packed_attention(layer, query, key, value, None, packed_bounds=[0, 30], sliding_window=64)
    causal, _ = packed_attention(layer, query, key, value, None, packed_bounds=[0, 30])
    torch.testing.assert_close(windowed, causal)
    narrow, _ = packed_attention(layer, query, key, value, None, packed_bounds=[0, 30], sliding_window=4)
    assert not torch.allclose(narrow, causal)


def test_a_mask_is_refused():
    query, key, value = qkv(4)
    with pytest.raises(ValueError, match="sequence bounds, not an attention mask"):
        packed_attention(Layer(), query, key, value, torch.zeros(1, 1, 4, 4))


def test_segmented_mixer_runs_each_sequence_alone():
    calls: list[int] = []

    def running_sum(hidden_states, **_kwargs):  # a recurrent mixer: each output depends on all before it
        calls.append(hidden_states.shape[1])
        return hidden_states.cumsum(dim=1)

    mixer = segment_sequences(running_sum)
    hidden = torch.arange(1.0, 8.0).reshape(1, 7, 1)
    out = mixer(hidden, packed_bounds=(0, 3, 7), cache_params=None, attention_mask=None)
    assert calls == [3, 4]
    assert out.flatten().tolist() == [1, 3, 6, 4, 9, 15, 22]
    assert mixer(hidden).flatten().tolist()[-1] == 28  # no bounds: one sequence
    with pytest.raises(ValueError, match="neither a cache nor padding"):
        mixer(hidden, packed_bounds=(0, 3, 7), attention_mask=torch.ones(1, 7))
