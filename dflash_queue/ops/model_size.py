"""A target's size from its text config's shapes: parameters (all of them, and those one token goes through in a
mixture of experts) and the attention cache one token takes (engines/cache_shapes.py), without loading a weight.

The shapes are those of Transformers' own decoder classes: attention (q, k, v, o; the gated query of Qwen3.5 and
Qwen3-Next; q/k norms; biases; gpt-oss's sinks), multi-head latent attention (DeepSeek-V3), Gated DeltaNet linear
attention (Qwen3.5, Qwen3-Next), Mamba-2 layers (Bamba), a dense MLP or experts (with a router, shared experts and
gpt-oss's biases), the layer norms, embeddings, final norm and the LM head unless tied.
`tests/ops/test_model_size.py` compares them with the parameters of every test family's model. Token mixers the
count does not know (short convolutions) are left out of it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_queue.engines.architecture import LINEAR_ATTENTION
from dflash_queue.engines.cache_shapes import (  # noqa: F401  (kv_cache_bytes_per_token, kv_heads_per_rank: this module's API too)
    attention_dims,
    is_latent_attention,
    kv_cache_bytes_per_token,
    kv_heads_per_rank,
    latent_cache_width,
    layer_kinds,
)

# Text models whose attention layers normalise queries and keys per head (q_norm, k_norm).
QK_NORM = frozenset(
    {"qwen3", "qwen3_moe", "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "gemma3_text", "qwen3_vl_text"}
)
# Text models whose query projection also produces an output gate (twice the query width).
GATED_QUERY = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text"})
# Text models with a norm before and after both the attention and the MLP (four per layer, not two).
FOUR_NORMS = frozenset({"gemma2", "gemma3_text"})
# Text models whose experts and router carry biases.
EXPERT_BIASES = frozenset({"gpt_oss"})
SINKS = frozenset({"gpt_oss"})
_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class ParameterCount:
    embedding: int
    layers: tuple[int, ...]  # per decoder layer, every expert
    active_layers: tuple[int, ...]  # per decoder layer, the experts one token is routed to
    final_norm: int
    lm_head: int  # 0 when tied to the embedding

    @property
    def total(self) -> int:
        return self.embedding + sum(self.layers) + self.final_norm + self.lm_head

    @property
    def active(self) -> int:
        """Parameters one token goes through, as model cards count them (embedding and LM head included)."""
        return self.embedding + sum(self.active_layers) + self.final_norm + self.lm_head


def count_parameters(text: Any) -> ParameterCount:
    """The parameters of the text decoder whose config is `text` (a Transformers text config)."""
    hidden, vocab = int(text.hidden_size), int(text.vocab_size)
    kinds = layer_kinds(text)
    norms = (4 if text.model_type in FOUR_NORMS else 2) * hidden
    layers, active = [], []
    for index, kind in enumerate(kinds):
        mixer = _MIXERS[kind](text) if kind in _MIXERS else 0
        mlp, mlp_active = mlp_parameters(text, index)
        layers.append(mixer + mlp + norms)
        active.append(mixer + mlp_active + norms)
    tied = bool(getattr(text, "tie_word_embeddings", False))
    return ParameterCount(
        embedding=vocab * hidden,
        layers=tuple(layers),
        active_layers=tuple(active),
        final_norm=hidden,
        lm_head=0 if tied else vocab * hidden,
    )


def attention_parameters(text: Any) -> int:
    if is_latent_attention(text):
        return latent_attention_parameters(text)
    hidden = int(text.hidden_size)
    heads, kv_heads, head_dim = attention_dims(text)
    query = heads * head_dim * (2 if text.model_type in GATED_QUERY else 1)
    count = hidden * query + 2 * hidden * kv_heads * head_dim + heads * head_dim * hidden
    if getattr(text, "attention_bias", False):
        count += query + 2 * kv_heads * head_dim + hidden
    if text.model_type in QK_NORM:
        count += 2 * head_dim
    if text.model_type in SINKS:
        count += heads
    return count


def latent_attention_parameters(text: Any) -> int:
    """Queries through a low-rank latent (q_a, its norm, q_b; or one q projection), keys and values from a shared
    latent plus a rotary key part (kv_a), its norm, kv_b to every head's no-position key and value, the output."""
    hidden, heads = int(text.hidden_size), int(text.num_attention_heads)
    nope, rope, value = int(text.qk_nope_head_dim), int(text.qk_rope_head_dim), int(text.v_head_dim)
    kv_rank, q_rank = int(text.kv_lora_rank), int(getattr(text, "q_lora_rank", None) or 0)
    bias = bool(getattr(text, "attention_bias", False))
    query = heads * (nope + rope)
    if q_rank:
        count = hidden * q_rank + q_rank + q_rank * query + (q_rank if bias else 0)
    else:
        count = hidden * query
    count += hidden * (kv_rank + rope) + kv_rank + kv_rank * heads * (nope + value)
    count += heads * value * hidden
    if bias:
        count += kv_rank + rope + hidden
    return count


def linear_attention_parameters(text: Any) -> int:
    if getattr(text, "mamba_n_heads", None):
        return mamba2_parameters(text)
    return gated_deltanet_parameters(text)


def mamba2_parameters(text: Any) -> int:
    """A Mamba-2 layer: the input projection (gate, x, B, C, time steps), the causal conv1d over x, B and C, per-head
    time-step bias, decay (A_log) and skip (D), the gated norm and the output projection."""
    hidden, heads = int(text.hidden_size), int(text.mamba_n_heads)
    inner = heads * int(text.mamba_d_head)
    groups_state = 2 * int(text.mamba_n_groups) * int(text.mamba_d_state)
    conv_dim = inner + groups_state
    count = hidden * (2 * inner + groups_state + heads) + conv_dim * int(text.mamba_d_conv) + 3 * heads + inner
    count += inner * hidden
    if getattr(text, "mamba_conv_bias", True):
        count += conv_dim
    if getattr(text, "mamba_proj_bias", False):
        count += 2 * inner + groups_state + heads + hidden
    return count


def gated_deltanet_parameters(text: Any) -> int:
    """A Gated DeltaNet layer: q, k, v, z, beta and alpha projections, the causal conv1d over q, k and v, per-head
    decay (A_log) and time-step bias, the gated output norm and the output projection."""
    hidden = int(text.hidden_size)
    value_heads = int(text.linear_num_value_heads)
    key_dim = int(text.linear_num_key_heads) * int(text.linear_key_head_dim)
    value_dim = value_heads * int(text.linear_value_head_dim)
    conv_dim = 2 * key_dim + value_dim
    return (
        hidden * (conv_dim + value_dim + 2 * value_heads)
        + conv_dim * int(text.linear_conv_kernel_dim)
        + 2 * value_heads
        + int(text.linear_value_head_dim)
        + value_dim * hidden
    )


_MIXERS = {
    "full_attention": attention_parameters,
    "sliding_attention": attention_parameters,
    LINEAR_ATTENTION: linear_attention_parameters,
}


def num_experts(text: Any) -> int:
    found = getattr(text, "num_experts", None) or getattr(text, "num_local_experts", None)
    return int(found or getattr(text, "n_routed_experts", None) or 0)


def is_sparse_layer(text: Any, index: int) -> bool:
    """Whether layer `index` runs experts: Qwen's MoE configs keep some layers dense (mlp_only_layers,
    decoder_sparse_step)."""
    if not num_experts(text) or index in (getattr(text, "mlp_only_layers", None) or ()):
        return False
    if getattr(text, "first_k_dense_replace", None) is not None:  # DeepSeek: dense first layers
        step = int(getattr(text, "moe_layer_freq", None) or 1)
        return index >= int(text.first_k_dense_replace) and index % step == 0
    step = int(getattr(text, "decoder_sparse_step", None) or 1)
    return (index + 1) % step == 0


def mlp_parameters(text: Any, index: int) -> tuple[int, int]:
    """(every parameter, those one token goes through) of layer `index`'s MLP or experts."""
    hidden = int(text.hidden_size)
    if not is_sparse_layer(text, index):
        dense = 3 * hidden * int(text.intermediate_size)
        if getattr(text, "mlp_bias", False):
            dense += 2 * int(text.intermediate_size) + hidden
        return dense, dense
    experts, routed = num_experts(text), int(text.num_experts_per_tok)
    width = int(getattr(text, "moe_intermediate_size", None) or text.intermediate_size)
    expert = 3 * hidden * width
    router = hidden * experts
    if text.model_type in EXPERT_BIASES:
        expert += 2 * width + hidden
        router += experts
    shared_width = int(getattr(text, "shared_expert_intermediate_size", None) or 0)
    shared = 3 * hidden * shared_width + hidden if shared_width else 0  # with its one-output gate
    if getattr(text, "n_shared_experts", None):  # DeepSeek: shared experts as one wider MLP, no gate
        shared = 3 * hidden * width * int(text.n_shared_experts)
    return experts * expert + router + shared, routed * expert + router + shared


def checkpoint_total_size(path: str | Path) -> int | None:
    """The bytes of every weight in a sharded checkpoint, as its index states them (`metadata.total_size`); None
    without an index (a single-file or weightless checkpoint)."""
    index = Path(path) / _INDEX
    if not index.is_file():
        return None
    total = json.loads(index.read_text(encoding="utf-8")).get("metadata", {}).get("total_size")
    return int(total) if total else None
