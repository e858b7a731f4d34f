"""Device memory a forward pass of the Transformers extract engine needs beyond the weights: what the engine
reports (`HiddenStateExtractor.activation_bytes`) and `plan` assumes."""

from __future__ import annotations

from typing import Any


def pass_activation_bytes(config: Any, tokens: int, captured: int, dtype_bytes: int) -> int:
    """Estimated device memory of a pass over `tokens` packed tokens of the decoder whose text config is
    `config`, capturing `captured` entries per token in a dtype of `dtype_bytes`.

    tokens x dtype bytes x (2 K H  +  3 H  +  max(2 (q_heads + kv_heads) head_dim,  3 I)) + 4 tokens x H:
    the capture buffers of this pass and of the previous one (still copying to the host), the residual
    stream, a layer's input norm and output, the larger of attention's q, k, v, output and the MLP's gate,
    up and product, and the per-token statistics' float32 copy of one layer. Allocator rounding and the attention
    kernel's workspace (O(tokens) for flash-style kernels) come on top.
    """
    hidden, intermediate = config.hidden_size, config.intermediate_size
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    per_token = 2 * captured * hidden + 3 * hidden + max(2 * (heads + kv_heads) * head_dim, 3 * intermediate)
    return tokens * (per_token * dtype_bytes + 4 * hidden)
