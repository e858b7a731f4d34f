"""Poison isolation: when a batch fails because of what is in it, find the samples at fault.

The batch is split and the halves run again, down to the single sample, so that one bad sample costs one dead
letter instead of its whole shard. When the error names the samples at fault, those run alone first and the
rest as one batch. Errors that say nothing about the samples (a dead engine, storage down) pass through.

A batch may hand over its results as they come (`run_isolating_streamed`): what it delivered before failing is
kept and never run again, so only the rest of the batch is split.
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

    def result(self, index: int) -> R:
        """The result of an item that was not poisoned."""
        value = self.results[index]
        assert value is not None, f"item {index} was poisoned"
        return value

    @property
    def ok(self) -> list[int]:
        poisoned = {i for i, _ in self.poisoned}
        return [i for i in range(len(self.results)) if i not in poisoned]


def run_isolating(
    items: Sequence[T], run: Callable[[list[T]], Sequence[R]], ids: Sequence[str]
) -> Isolated[R]:
    """`run(batch)` returns one result per item; `ids[i]` names item i in error messages and hints."""
    results: list[R | None] = [None] * len(items)

    def run_batch(batch: list[T], deliver: Callable[[int, R], None]) -> None:
        for position, result in enumerate(_strict(run(batch), len(batch))):
            deliver(position, result)

    outcome = run_isolating_streamed(items, run_batch, ids, results.__setitem__)
    outcome.results = results
    return outcome


def run_isolating_streamed(
    items: Sequence[T],
    run: Callable[[list[T], Callable[[int, R], None]], None],
    ids: Sequence[str],
    deliver: Callable[[int, R], None],
) -> Isolated[R]:
    """`run(batch, done)` calls `done(j, result)` once per item j of `batch` as soon as its result is ready;
    each reaches `deliver(i, result)` with i the item's index in `items`. The outcome's `results` stay None."""
    outcome: Isolated[R] = Isolated([None] * len(items))

    def attempt(indices: list[int]) -> None:
        outcome.attempts += 1
        delivered: set[int] = set()

        def done(position: int, result: R) -> None:
            delivered.add(indices[position])
            deliver(indices[position], result)

        try:
            run([items[i] for i in indices], done)
        except SAMPLE_DEPENDENT as exc:
            left = [i for i in indices if i not in delivered]
            if not left:  # every item came back: the error cannot be pinned on one of them
                raise
            if len(left) == 1:
                outcome.poisoned.append((left[0], exc))
                return
            named = set(getattr(exc, "sample_ids", ()))
            suspects = [i for i in left if ids[i] in named]
            if suspects and len(suspects) < len(left):
                attempt([i for i in left if i not in suspects])
                for suspect in suspects:
                    attempt([suspect])
            else:
                middle = len(left) // 2
                attempt(left[:middle])
                attempt(left[middle:])

    if items:
        attempt(list(range(len(items))))
    outcome.poisoned.sort(key=lambda pair: pair[0])
    return outcome


def _strict(results: Sequence[R], count: int) -> Sequence[R]:
    if len(results) != count:
        raise ValueError(f"a batch of {count} items returned {len(results)} results")
    return results
