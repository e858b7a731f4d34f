"""Packing variable-length sequences into forward passes without padding.

A pack is a list of sequence indices whose tokens are concatenated into one row of at most `token_budget` tokens.
Position ids restart at 0 for every sequence and attention is confined to each sequence (block-diagonal causal),
so every computed token is a useful one and no sample attends to another. A sequence longer than the budget runs
alone in a pack of its own.

Padded batching (rows x longest row) is kept here too, as the baseline the padding benchmark compares against.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def plan_packs(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices grouped into packs of at most `token_budget` tokens, by first-fit decreasing.

    Every index appears in exactly one pack; a sequence longer than the budget is alone in its pack. Longest
    sequences come first, so the last packs take the short ones that fill the gaps.
    """
    if token_budget < 1:
        raise ValueError(f"token_budget must be >= 1, got {token_budget}")
    if any(n < 1 for n in lengths):
        raise ValueError("every sequence must hold at least one token")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    packs: list[list[int]] = []
    free: list[int] = []  # tokens left in each pack
    for index in order:
        length = lengths[index]
        for slot, room in enumerate(free):
            if length <= room:
                packs[slot].append(index)
                free[slot] -= length
                break
        else:
            packs.append([index])
            free.append(max(token_budget - length, 0))
    return packs


def plan_padded_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices grouped so that each padded batch (rows x longest row) fits the budget, longest first."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        width = lengths[current[0]] if current else lengths[index]
        if current and (len(current) + 1) * width > token_budget:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


def cu_seqlens(lengths: Sequence[int]) -> list[int]:
    """Offsets of each sequence in the packed row, with the total last: [0, n0, n0 + n1, ...]."""
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    return offsets


def packed_position_ids(lengths: Sequence[int]) -> torch.Tensor:
    """Position ids [1, sum(lengths)] restarting at 0 for every sequence."""
    return torch.cat([torch.arange(n, dtype=torch.long) for n in lengths]).unsqueeze(0)


def padded_tokens(batches: Sequence[Sequence[int]], lengths: Sequence[int]) -> int:
    """Tokens computed by padded batches: each batch costs rows x its longest row."""
    return sum(len(batch) * max(lengths[i] for i in batch) for batch in batches)


def padding_efficiency(useful_tokens: int, computed_tokens: int) -> float:
    """Useful tokens / computed tokens: 1.0 means no FLOP is spent on padding."""
    return useful_tokens / computed_tokens if computed_tokens else 1.0


def attention_pairs(lengths: Sequence[int]) -> int:
    """Query-key pairs a causal attention computes over these sequences, each on its own: sum n (n + 1) / 2."""
    return sum(n * (n + 1) // 2 for n in lengths)
