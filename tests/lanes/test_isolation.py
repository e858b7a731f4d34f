"""Poison isolation: a batch that fails because of a sample is split down to that sample."""

from __future__ import annotations

import pytest
import torch

from dflash_queue.errors import EngineUnavailable, SampleDependentError
from dflash_queue.lanes.isolation import run_isolating


def engine(poison: set[int], calls: list[list[int]], *, name_culprits: bool = False, error=SampleDependentError):
    def run(batch: list[int]) -> list[int]:
        calls.append(list(batch))
        bad = [x for x in batch if x in poison]
        if bad:
            raise error("boom", sample_ids=tuple(str(x) for x in bad) if name_culprits else ())
        return [x * 10 for x in batch]

    return run


@pytest.mark.parametrize("poison", [set(), {0}, {13}, {5, 6}, {0, 7, 15}, set(range(16))])
def test_only_the_poison_samples_are_lost(poison):
    items = list(range(16))
    calls: list[list[int]] = []
    outcome = run_isolating(items, engine(poison, calls), [str(i) for i in items])
    assert [i for i, _ in outcome.poisoned] == sorted(poison)
    assert all(isinstance(exc, SampleDependentError) for _, exc in outcome.poisoned)
    assert outcome.results == [None if i in poison else i * 10 for i in items]
    assert outcome.ok == [i for i in items if i not in poison]
    # Bisection: a single poison sample costs about 2 log2(n) extra batches, not n.
    if len(poison) == 1:
        assert outcome.attempts <= 1 + 2 * 4


def test_named_culprits_are_run_alone_and_the_rest_together():
    calls: list[list[int]] = []
    outcome = run_isolating(list(range(10)), engine({3}, calls, name_culprits=True), [str(i) for i in range(10)])
    assert [i for i, _ in outcome.poisoned] == [3]
    assert calls == [list(range(10)), [0, 1, 2, 4, 5, 6, 7, 8, 9], [3]]


def test_out_of_memory_that_reaches_the_lane_is_isolated_too():
    calls: list[list[int]] = []
    outcome = run_isolating([1, 2, 3], engine({2}, calls, error=lambda m, sample_ids: torch.OutOfMemoryError(m)), "abc")
    assert [i for i, _ in outcome.poisoned] == [1]


def test_errors_that_say_nothing_about_the_samples_pass_through():
    def dead_engine(batch):
        raise EngineUnavailable("engine core died")

    with pytest.raises(EngineUnavailable):
        run_isolating([1, 2, 3], dead_engine, "abc")
