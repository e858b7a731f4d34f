"""A lane task's message: references only (a shard id, its sample count, the config fingerprint), `redo` (set by
a requeued dead letter) and, for a later epoch only, `epoch`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class LaneMessage:
    shard_id: str
    num_samples: int
    fingerprint: str
    redo: bool = False
    epoch: int = 0

    @property
    def args(self) -> tuple[str, int, str]:
        return (self.shard_id, self.num_samples, self.fingerprint)

    @property
    def kwargs(self) -> dict[str, Any]:
        """`epoch` only for a later epoch, so epoch 0's messages stay as they were."""
        return {"redo": self.redo, "epoch": self.epoch} if self.epoch else {"redo": self.redo}
