"""Poison isolation: a batch that fails because of a sample is split down to that sample."""

from __future__ import annotations

import pytest
import torch

from dflash_queue.errors import EngineUnavailable, SampleDependentError
from dflash_queue.lanes.isolation import run_isolating, run_isolating_streamed


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


def test_results_delivered_before_a_failure_are_kept_and_not_run_again():
    """A streaming batch hands over results as they come; a poison item fails the batch after some were delivered."""
    calls: list[list[int]] = []
    delivered: dict[int, int] = {}

    def run(batch: list[int], done) -> None:
        calls.append(list(batch))
        for position, item in enumerate(batch):
            if item == 5:
                raise SampleDependentError("boom")
            done(position, item * 10)

    outcome = run_isolating_streamed(list(range(8)), run, [str(i) for i in range(8)], delivered.__setitem__)
    assert [i for i, _ in outcome.poisoned] == [5]
    assert delivered == {i: i * 10 for i in range(8) if i != 5}
    assert calls[0] == list(range(8)) and all(0 not in batch for batch in calls[1:])  # only 5, 6, 7 run again
    assert sorted(i for batch in calls[1:] for i in batch if i != 5) == [6, 7]


def test_a_failure_after_every_item_was_delivered_passes_through():
    def run(batch, done):
        for position, item in enumerate(batch):
            done(position, item)
        raise SampleDependentError("names nobody left")

    with pytest.raises(SampleDependentError, match="names nobody left"):
        run_isolating_streamed([1, 2], run, "ab", lambda i, r: None)
