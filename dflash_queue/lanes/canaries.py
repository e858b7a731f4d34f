"""Which samples of a shard the canary recomputes, picked while the shard's states stream past.

Drawn from the shard id, so a re-delivered task checks the same ones; preferably from the samples that followed
another in their forward pass (the first sequence of a pass sees nothing before it, so a leak between sequences
could not show in it) and are no longer than the shard's median, which keeps one canary below an average
sample's cost (a sample alone computes a little less efficiently than in a pack). Whether a sample followed
another is known only once its pass ran, so the picker ranks every offered sample and keeps copies of the states
of the best `count` seen so far: never more than `count` samples' states, whatever the shard size.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch


class CanaryPicker:
    def __init__(self, shard_id: str, lengths: Sequence[int], count: int) -> None:
        self.count = count
        self.lengths = list(lengths)
        self.median = sorted(self.lengths)[(len(self.lengths) - 1) // 2] if self.lengths else 0
        order = list(range(len(self.lengths)))
        random.Random(shard_id).shuffle(order)
        self._rank = {index: rank for rank, index in enumerate(order)}
        self._kept: dict[int, tuple[tuple[int, int], torch.Tensor]] = {}

    def offer(self, index: int, states: torch.Tensor, pass_position: int) -> None:
        """Keep a copy of `states` if the sample is among the best `count` candidates offered so far."""
        if self.count <= 0:
            return
        follower = pass_position > 0
        tier = 0 if follower and self.lengths[index] <= self.median else 1 if follower else 2
        key = (tier, self._rank[index])
        if len(self._kept) >= self.count:
            worst = max(self._kept, key=lambda i: self._kept[i][0])
            if key >= self._kept[worst][0]:
                return
            del self._kept[worst]
        # A copy: a view would keep its whole forward pass's states alive.
        self._kept[index] = (key, states.clone())

    def chosen(self, ok: Sequence[int]) -> list[tuple[int, torch.Tensor]]:
        """(index, states) of the kept samples still in the shard, in shard order."""
        allowed = set(ok)
        return [(i, states) for i, (_, states) in sorted(self._kept.items()) if i in allowed]
