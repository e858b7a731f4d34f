"""The forward passes of the extract engine: which sequences share one, its inputs, and the per-token statistics
its captured states are checked with.

* packed: the sequences concatenated in one row, position ids restarting per sequence, and their offsets
  (cu_seqlens) for the token mixers that confine themselves to each sequence;
* padded: one right-padded row per sequence with an attention mask; each sequence's real tokens come first,
  so causal attention never lets them see the padding.

Either way each sequence occupies a span of the flattened [rows x width] tokens of the pass, where the capture
hooks write its states.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_queue.engines.packing import cu_seqlens, packed_position_ids, plan_packs, plan_padded_batches


@dataclass(frozen=True)
class PassInputs:
    tensors: dict[str, torch.Tensor]  # model inputs, on the CPU
    spans: list[tuple[int, int]]  # each sequence's rows in the flattened tokens of the pass
    bounds: list[int] | None = None  # packed: the sequences' offsets in the row


def plan_passes(mode: str, lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    return plan_packs(lengths, token_budget) if mode == "packed" else plan_padded_batches(lengths, token_budget)


def packed_inputs(sequences: Sequence[Sequence[int]]) -> PassInputs:
    lengths = [len(s) for s in sequences]
    bounds = cu_seqlens(lengths)
    return PassInputs(
        {
            "input_ids": torch.tensor([t for s in sequences for t in s])[None],
            "position_ids": packed_position_ids(lengths),
        },
        list(zip(bounds[:-1], bounds[1:])),
        bounds,
    )


def padded_inputs(sequences: Sequence[Sequence[int]]) -> PassInputs:
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    spans = [(row * width, row * width + len(s)) for row, s in enumerate(sequences)]
    return PassInputs({"input_ids": ids, "attention_mask": mask}, spans)


def token_stats(buffer: torch.Tensor) -> torch.Tensor:
    """[rows, K, 3] float32: per token and captured layer, the largest value, the smallest and the RMS."""
    stats = torch.empty((buffer.shape[0], buffer.shape[1], 3), dtype=torch.float32, device=buffer.device)
    width = buffer.shape[2]
    for k in range(buffer.shape[1]):  # one layer at a time: [rows, H] reductions, no [rows, K, H] temporary
        layer = buffer[:, k]
        stats[:, k, 0] = layer.amax(dim=1)
        stats[:, k, 1] = layer.amin(dim=1)
        stats[:, k, 2] = torch.linalg.vector_norm(layer, dim=1, dtype=torch.float32) / width**0.5
    return stats


def summarize(stats: torch.Tensor) -> torch.Tensor:
    """One sequence's [T, K, 3] token statistics -> [K, 3]: largest value, smallest, median token RMS."""
    return torch.stack([stats[..., 0].amax(0), stats[..., 1].amin(0), stats[..., 2].median(0).values], dim=1)
