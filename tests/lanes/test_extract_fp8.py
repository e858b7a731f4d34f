"""fp8_e4m3 storage through the real extract lane: error against float32 and bfloat16 storage of the same
states, and the bytes it saves."""

from __future__ import annotations

from pathlib import Path

import torch

from dflash_queue.training import ShardDataset


def relative_errors(stored: ShardDataset, reference: ShardDataset) -> torch.Tensor:
    """||stored - reference|| / ||reference|| for every (token, layer) vector of every sample."""
    out = []
    for i in range(len(reference)):
        want, got = reference[i], stored[i]
        assert got["sample_id"] == want["sample_id"]
        diff = got["hidden_states"] - want["hidden_states"]
        out.append((diff.norm(dim=-1) / want["hidden_states"].norm(dim=-1)).flatten())
    return torch.cat(out)


def shard_bytes(root: str) -> int:
    return sum(p.stat().st_size for p in Path(root, "shards").glob("*.safetensors"))


def test_fp8_states_stay_within_the_e4m3_bound_and_take_half_the_bytes(pipeline_shards):
    roots = {dtype: config.storage.url for dtype, config in pipeline_shards.items()}
    as_f32 = {dtype: ShardDataset(root, hidden_dtype=torch.float32) for dtype, root in roots.items()}
    reference = as_f32["float32"]
    fp8 = relative_errors(as_f32["fp8_e4m3"], reference)
    bf16 = relative_errors(as_f32["bfloat16"], reference)
    fp8_vs_bf16 = relative_errors(as_f32["fp8_e4m3"], as_f32["bfloat16"])
    print(
        f"\nrelative error per (token, layer) vector over {reference.num_tokens} tokens x {len(reference.layer_ids)} "
        f"layers: fp8 vs float32 mean {fp8.mean():.4f} max {fp8.max():.4f}; bf16 vs float32 mean {bf16.mean():.5f} "
        f"max {bf16.max():.5f}; fp8 vs bf16 mean {fp8_vs_bf16.mean():.4f} max {fp8_vs_bf16.max():.4f}"
    )
    # e4m3 rounds each element to 3 mantissa bits: at most 2**-4 relative, ~2.5% on average over a vector.
    assert fp8.max() <= 2**-4 and fp8.mean() <= 0.035
    assert fp8_vs_bf16.max() <= 2**-4 + 2**-8 and fp8_vs_bf16.mean() <= 0.035
    # bf16 keeps 8 bits: at most 2**-9 relative per element.
    assert bf16.max() <= 2**-8
    # ... and the fp8 shards really hold e4m3 values with scales (not bf16 under another name).
    assert fp8.mean() > 5 * bf16.mean()
    index = as_f32["fp8_e4m3"].shards[0]
    assert index.dtype == "fp8_e4m3" and index.layout["hidden_states"].dtype == "F8_E4M3"
    assert index.layout["hidden_scales"].shape == (index.num_tokens, 3)

    tokens = reference.num_tokens
    per_token = {dtype: shard_bytes(root) / tokens for dtype, root in roots.items()}
    print("shard bytes per token: " + ", ".join(f"{d} {b:.0f}" for d, b in per_token.items()))
    # K=3, H=128: bf16 768 B/token, fp8 384 + 12 of scales; ids, mask and headers are shared overhead.
    assert per_token["fp8_e4m3"] / per_token["bfloat16"] <= 0.56
