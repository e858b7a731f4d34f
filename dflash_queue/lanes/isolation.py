"""Poison isolation: when a batch fails because of what is in it, find the samples at fault.

The batch is split and the halves run again, down to the single sample, so that one bad sample costs one dead
letter instead of its whole shard. When the error names the samples at fault, those run alone first and the
rest as one batch. Errors that say nothing about the samples (a dead engine, storage down) pass through.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch
from jinja2 import TemplateError

from dflash_queue.errors import GenerationRejected, SampleDependentError

T = TypeVar("T")
R = TypeVar("R")

# Failures that depend on the samples in the batch. An out-of-memory that reaches the lane is one the engine
# could not absorb by shrinking its batch; a template error is a sample the chat template cannot render.
SAMPLE_DEPENDENT: tuple[type[BaseException], ...] = (
    SampleDependentError,
    GenerationRejected,
    torch.OutOfMemoryError,
    TemplateError,
)


@dataclass
class Isolated(Generic[R]):
    # One per item, in item order; None where the item was poisoned.
    results: list[R | None]
    # (item index, the error it alone caused), in item order.
    poisoned: list[tuple[int, BaseException]] = field(default_factory=list)
    # Batches run, the first included: 1 when nothing failed.
    attempts: int = 0

    @property
    def ok(self) -> list[int]:
        poisoned = {i for i, _ in self.poisoned}
        return [i for i in range(len(self.results)) if i not in poisoned]


def run_isolating(
    items: Sequence[T], run: Callable[[list[T]], Sequence[R]], ids: Sequence[str]
) -> Isolated[R]:
    """`run(batch)` returns one result per item; `ids[i]` names item i in error messages and hints."""
    outcome: Isolated[R] = Isolated([None] * len(items))

    def attempt(indices: list[int]) -> None:
        outcome.attempts += 1
        try:
            results = run([items[i] for i in indices])
        except SAMPLE_DEPENDENT as exc:
            if len(indices) == 1:
                outcome.poisoned.append((indices[0], exc))
                return
            named = set(getattr(exc, "sample_ids", ()))
            suspects = [i for i in indices if ids[i] in named]
            if suspects and len(suspects) < len(indices):
                attempt([i for i in indices if i not in suspects])
                for suspect in suspects:
                    attempt([suspect])
            else:
                middle = len(indices) // 2
                attempt(indices[:middle])
                attempt(indices[middle:])
            return
        for index, result in zip(indices, results, strict=True):
            outcome.results[index] = result

    if items:
        attempt(list(range(len(items))))
    outcome.poisoned.sort(key=lambda pair: pair[0])
    return outcome
