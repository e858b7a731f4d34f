"""The attention cache one token takes, from a text config's shapes alone: what `plan` sizes GPUs with and what the
vLLM engines size their cache with on a CPU device."""

from __future__ import annotations

from typing import Any

from dflash_queue.engines.architecture import ATTENTION_LAYERS, profile_config


def layer_kinds(text: Any) -> tuple[str, ...]:
    """Each decoder layer's token mixer (full_attention, sliding_attention, linear_attention, ...)."""
    return profile_config(text).layer_types


def attention_dims(text: Any) -> tuple[int, int, int]:
    """(query heads, key/value heads, head size)."""
    heads = int(text.num_attention_heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
    return heads, kv_heads, head_dim


def is_latent_attention(text: Any) -> bool:
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi K2): keys and values from a compressed latent."""
    return bool(getattr(text, "kv_lora_rank", None))


def latent_cache_width(text: Any) -> int:
    """What multi-head latent attention caches per token and layer: the latent and the rotary key part."""
    return int(text.kv_lora_rank) + int(text.qk_rope_head_dim)


def kv_heads_per_rank(kv_heads: int, tensor_parallel_size: int) -> int:
    """Key/value heads each tensor-parallel rank caches: fewer heads than ranks are replicated (vLLM's
    `get_num_kv_heads`), so the cache stops shrinking at one head per rank."""
    return max(1, kv_heads // tensor_parallel_size)


def kv_cache_bytes_per_token(text: Any, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
    """Keys and values one token takes on one rank, over the attention layers. Multi-head latent attention caches its latent instead. Sliding-window layers count in
    full: an extraction's tokens are all being prefilled, when a window has freed nothing yet. Linear-attention
    layers hold a fixed state per sequence instead, left out here."""
    layers = sum(kind in ATTENTION_LAYERS for kind in layer_kinds(text))
    if is_latent_attention(text):  # one latent per token, the same on every rank
        return layers * latent_cache_width(text) * dtype_bytes
    _, kv_heads, head_dim = attention_dims(text)
    return 2 * layers * kv_heads_per_rank(kv_heads, tensor_parallel_size) * head_dim * dtype_bytes
