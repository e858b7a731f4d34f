"""Parameter and cache sizes from a config's shapes: by hand for a Qwen3-235B-A22B-class config, and against the
parameters of every test family's Transformers model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, Qwen3Config, Qwen3MoeConfig

from dflash_queue.ops.model_size import (
    checkpoint_total_size,
    count_parameters,
    kv_cache_bytes_per_token,
    kv_heads_per_rank,
)
from dfq_testing.families import FAMILIES

REPO = Path(__file__).resolve().parents[2]
QWEN3_235B = REPO / "examples" / "qwen3-235b-a22b-class"


def test_qwen3_235b_a22b_counted_by_hand():
    count = count_parameters(AutoConfig.from_pretrained(QWEN3_235B))
    hidden, vocab, layers = 4096, 151_936, 94
    # Attention: q 4096 x (64 x 128), k and v 4096 x (4 x 128), o (64 x 128) x 4096, q/k norms of 128.
    attention = 4096 * 8192 + 2 * 4096 * 512 + 8192 * 4096 + 2 * 128
    assert attention == 71_303_424
    # 128 experts of gate, up and down (4096 x 1536 each), the router 4096 x 128; two norms of 4096.
    experts, router, norms = 128 * 3 * 4096 * 1536, 4096 * 128, 2 * 4096
    assert experts == 2_415_919_104
    layer = attention + experts + router + norms
    assert count.layers == (layer,) * layers and layer == 2_487_755_008
    # Embedding and an untied LM head of 151,936 x 4096, the final norm.
    assert count.total == layers * layer + 2 * vocab * hidden + hidden == 235_093_634_560
    # One token goes through 8 of the 128 experts: 22.2B active ("A22B").
    active_layer = attention + 8 * 3 * 4096 * 1536 + router + norms
    assert count.active == layers * active_layer + 2 * vocab * hidden + hidden == 22_190_763_520


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"lfm2"}))  # LFM2's short convolutions are not counted
def test_every_family_counts_the_parameters_transformers_builds(family):
    with torch.device("meta"):
        model = FAMILIES[family].build(256)
    decoder = getattr(model.model, "language_model", model.model)
    built = sum(p.numel() for p in decoder.parameters()) + model.lm_head.weight.numel()
    assert count_parameters(model.config.get_text_config()).total == built


def test_dense_and_sparse_layers_of_a_qwen_moe():
    config = Qwen3MoeConfig(
        vocab_size=100, hidden_size=16, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=4, num_experts_per_tok=2,
        decoder_sparse_step=2, mlp_only_layers=[3], tie_word_embeddings=True,
    )
    count = count_parameters(config)
    attention = 16 * 16 + 2 * 16 * 8 + 16 * 16 + 2 * 8  # 784
    dense = 3 * 16 * 40
    sparse, active = 4 * 3 * 16 * 8 + 16 * 4, 2 * 3 * 16 * 8 + 16 * 4
    # Layers 1 and 3 would be sparse (every second one), but layer 3 is in mlp_only_layers.
    assert count.layers == tuple(attention + mlp + 32 for mlp in (dense, sparse, dense, dense))
    assert count.active_layers == tuple(attention + mlp + 32 for mlp in (dense, active, dense, dense))
    assert count.lm_head == 0 and count.total == 100 * 16 + sum(count.layers) + 16  # tied


def test_kv_cache_per_token_over_the_attention_layers_and_the_ranks():
    dense = Qwen3Config(hidden_size=64, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=8, head_dim=16)
    # 2 (k, v) x 6 layers x 8 heads x 16 x 2 bytes; tensor parallel 4 splits the heads: 2 per rank.
    assert kv_cache_bytes_per_token(dense, 2) == 2 * 6 * 8 * 16 * 2 == 3072
    assert kv_cache_bytes_per_token(dense, 2, 4) == 2 * 6 * 2 * 16 * 2
    # Fewer key/value heads than ranks are replicated: 4 heads over 8 ranks is one head each, not half.
    assert kv_heads_per_rank(4, 8) == 1 and kv_heads_per_rank(4, 2) == 2
    hybrid = AutoConfig.from_pretrained(REPO / "examples" / "qwen3.6-27b-class").get_text_config()
    # Qwen3.6-27B: 16 full-attention layers of 4 heads of 256; the 48 linear-attention layers hold a fixed state.
    assert kv_cache_bytes_per_token(hybrid, 2) == 2 * 16 * 4 * 256 * 2 == 65_536
    qwen3_235b = AutoConfig.from_pretrained(QWEN3_235B)
    assert kv_cache_bytes_per_token(qwen3_235b, 2, 8) == 2 * 94 * 1 * 128 * 2 == 48_128


def test_checkpoint_total_size_from_the_index(tmp_path):
    assert checkpoint_total_size(tmp_path) is None
    index = {"metadata": {"total_size": 470_187_269_120}, "weight_map": {"lm_head.weight": "model-1.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    assert checkpoint_total_size(tmp_path) == 470_187_269_120


def test_latent_attention_caches_its_latent_once_per_token_and_layer():
    """DeepSeek-V3's attention caches the 32-wide latent and the 16-wide rotary key part, not keys and values per
    head, and the same latent on every tensor-parallel rank."""
    with torch.device("meta"):
        model = FAMILIES["deepseek_v3"].build(256)
    text = model.config.get_text_config()
    assert kv_cache_bytes_per_token(text, 2) == 6 * (32 + 16) * 2
    assert kv_cache_bytes_per_token(text, 2, tensor_parallel_size=8) == 6 * (32 + 16) * 2
