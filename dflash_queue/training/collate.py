"""Batching samples of different lengths: right padding plus an attention mask."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

PADDED = ("input_ids", "loss_mask", "hidden_states", "hidden_scales")


def collate_padded(items: Sequence[dict[str, Any]], *, pad_id: int = 0) -> dict[str, Any]:
    """Stack `ShardDataset` items into [B, T_max, ...] tensors.

    Padding positions get `pad_id` in `input_ids`, 0 in `loss_mask`, `hidden_states` (and `hidden_scales`), 0 in
    `attention_mask` (1 on real tokens); `lengths` holds each sample's token count. Metadata fields become
    lists in batch order.
    """
    if not items:
        raise ValueError("cannot collate an empty batch")
    lengths = torch.tensor([item["input_ids"].shape[0] for item in items], dtype=torch.int64)
    width = int(lengths.max())
    batch: dict[str, Any] = {}
    for name in PADDED:
        if name not in items[0]:
            continue
        first = items[0][name]
        fill = pad_id if name == "input_ids" else 0
        out = torch.full((len(items), width, *first.shape[1:]), fill, dtype=first.dtype)
        for row, item in enumerate(items):
            out[row, : item[name].shape[0]] = item[name]
        batch[name] = out
    batch["attention_mask"] = (torch.arange(width)[None, :] < lengths[:, None]).to(torch.int64)
    batch["lengths"] = lengths
    for name in items[0]:
        if name not in batch:
            batch[name] = [item[name] for item in items]
    return batch
