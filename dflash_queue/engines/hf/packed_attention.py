"""Token mixers confined to each sequence of a packed row.

`packed_attention` is registered with Transformers' AttentionInterface and selected by name; the model calls it
with the layer's own extras, and it applies them inside each sequence exactly as the model's eager attention
does on that sequence alone:

* `sliding_window` w: a query attends to the w most recent keys, itself included (Transformers' mask:
  kv > q - w). Long sequences are computed in query blocks that only read the keys their window reaches;
* `softcap` c: logits become c * tanh(logits / c) before the mask (Gemma 2);
* `s_aux` (attention sinks, gpt-oss): one learnt logit per head joins the softmax and is dropped after it.

Logits are computed and normalised in the same dtypes as the model's eager attention, so that bfloat16 results
match it too (a mixture-of-experts router turns a rounding difference into another expert).

Without soft-capping or sinks each sequence is one causal SDPA call (no mask is built; on CUDA SDPA picks its
flash kernel), so attention costs sum(len^2), not pack_len^2. With them, a float32 softmax over the sequence's
logits, as Transformers' eager attention computes it.

`segment_sequences` wraps a linear-attention module (Gated DeltaNet) so that it runs on each sequence of the
row in turn: its causal conv1d and its recurrent state start from zero at every sequence, as they do when the
sequence runs alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn
from transformers import AttentionInterface

# The name must contain neither "flash" nor "sdpa": Transformers would check the model supports those kernels.
PACKED_ATTENTION = "dfq_packed_causal"
# Query rows per block for windowed or eager attention: bounds the logits held at once to heads x block x keys.
QUERY_BLOCK = 1024


def packed_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    packed_bounds: Sequence[int] | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **_kwargs,
) -> tuple[torch.Tensor, None]:
    """query and key [B, heads or kv_heads, T, d], value [B, kv_heads, T, dv]; returns [B, T, heads, dv] (dv
    differs from d in multi-head latent attention). `packed_bounds` are the sequences' offsets in the row
    (cu_seqlens); None means one sequence."""
    if attention_mask is not None:
        raise ValueError("packed attention takes sequence bounds, not an attention mask")
    bounds = packed_bounds if packed_bounds is not None else (0, query.shape[2])
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = query.new_empty(query.shape[0], query.shape[2], query.shape[1], value.shape[3])
    for start, end in zip(bounds[:-1], bounds[1:]):
        q, k, v = query[:, :, start:end], key[:, :, start:end], value[:, :, start:end]
        if softcap is None and s_aux is None and (not sliding_window or end - start <= sliding_window):
            attended = nn.functional.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1]
            )
        else:
            attended = _blocked_attention(q, k, v, scale, sliding_window, softcap, s_aux)
        out[:, start:end] = attended.transpose(1, 2)
    return out, None


def _blocked_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Causal attention over one sequence, query block by query block, each reading only the keys it may see."""
    length = query.shape[2]
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    out = query.new_empty(*query.shape[:3], value.shape[3])
    positions = torch.arange(length, device=query.device)
    for first in range(0, length, QUERY_BLOCK):
        last = min(first + QUERY_BLOCK, length)
        lowest = max(0, first - window + 1) if window else 0
        q_pos, k_pos = positions[first:last, None], positions[None, lowest:last]
        visible = k_pos <= q_pos
        if window:
            visible &= k_pos > q_pos - window
        q, k, v = query[:, :, first:last], key[:, :, lowest:last], value[:, :, lowest:last]
        if softcap is None and sinks is None:
            out[:, :, first:last] = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, scale=scale)
            continue
        logits = torch.matmul(q, k.transpose(2, 3)) * scale
        if softcap is not None:
            logits = torch.tanh(logits / softcap) * softcap
        logits = logits.masked_fill(~visible, float("-inf"))
        if sinks is not None:
            # As gpt-oss's eager attention: shift by the row maximum, softmax in the logits' dtype.
            sink = sinks.reshape(1, -1, 1, 1).to(logits.dtype).expand(logits.shape[0], -1, logits.shape[2], 1)
            combined = torch.cat([logits, sink], dim=-1)
            combined = combined - combined.amax(dim=-1, keepdim=True)
            probs = torch.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        out[:, :, first:last] = torch.matmul(probs.to(v.dtype), v)
    return out


AttentionInterface.register(PACKED_ATTENTION, packed_attention)


def segment_sequences(forward: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """A linear-attention forward that runs each sequence of a packed row on its own (given `packed_bounds`)."""

    def run(hidden_states: torch.Tensor, *args, packed_bounds: Sequence[int] | None = None, **kwargs) -> torch.Tensor:
        if packed_bounds is None or len(packed_bounds) <= 2:
            return forward(hidden_states, *args, **kwargs)
        if kwargs.get("cache_params") is not None or kwargs.get("attention_mask") is not None:
            raise ValueError("a packed row has neither a cache nor padding")
        parts = [
            forward(hidden_states[:, start:end], *args, **kwargs)
            for start, end in zip(packed_bounds[:-1], packed_bounds[1:])
        ]
        return torch.cat(parts, dim=1)

    run.segmented = True  # type: ignore[attr-defined]
    return run
