from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dflash_queue.engines.packing import (
    attention_pairs,
    cu_seqlens,
    packed_position_ids,
    padded_tokens,
    padding_efficiency,
    plan_packs,
    plan_padded_batches,
)

lengths_st = st.lists(st.integers(min_value=1, max_value=300), max_size=60)
budget_st = st.integers(min_value=1, max_value=512)


@given(lengths_st, budget_st)
def test_every_index_is_in_exactly_one_pack(lengths, budget):
    packs = plan_packs(lengths, budget)
    assert sorted(i for pack in packs for i in pack) == list(range(len(lengths)))


@given(lengths_st, budget_st)
def test_packs_fit_the_budget_unless_one_sequence_alone_exceeds_it(lengths, budget):
    for pack in plan_packs(lengths, budget):
        tokens = sum(lengths[i] for i in pack)
        assert tokens <= budget or (len(pack) == 1 and lengths[pack[0]] > budget)


@given(lengths_st, budget_st)
def test_first_fit_leaves_no_two_packs_that_could_merge(lengths, budget):
    """First-fit opens a pack only when the sequence fits in none before it: no two packs both at most half full."""
    sizes = [sum(lengths[i] for i in pack) for pack in plan_packs(lengths, budget)]
    assert sum(1 for s in sizes if 2 * s <= budget) <= 1


def test_packs_are_filled_with_short_sequences_after_long_ones():
    assert plan_packs([100, 3, 50, 50, 49, 10, 400, 7], token_budget=128) == [[6], [0, 5, 7, 1], [2, 3], [4]]


def test_plan_packs_rejects_empty_sequences_and_budgets():
    with pytest.raises(ValueError, match="at least one token"):
        plan_packs([3, 0], 10)
    with pytest.raises(ValueError, match="token_budget"):
        plan_packs([3], 0)


def test_position_ids_restart_for_every_sequence():
    assert packed_position_ids([3, 1, 2]).tolist() == [[0, 1, 2, 0, 0, 1]]
    assert cu_seqlens([3, 1, 2]) == [0, 3, 4, 6]
    assert cu_seqlens([]) == [0]


def test_position_ids_mark_the_same_sequences_as_transformers_packed_detection():
    from transformers.masking_utils import find_packed_sequence_indices

    positions = packed_position_ids([3, 1, 1, 4])
    assert find_packed_sequence_indices(positions).tolist() == [[0, 0, 0, 1, 2, 3, 3, 3, 3]]


@given(lengths_st, budget_st)
def test_padded_batches_fit_the_budget(lengths, budget):
    batches = plan_padded_batches(lengths, budget)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        assert len(batch) * max(lengths[i] for i in batch) <= budget or len(batch) == 1


def test_padding_efficiency_counts_rows_times_longest_row():
    lengths = [10, 4, 4, 1]
    assert padded_tokens([[0, 1], [2, 3]], lengths) == 2 * 10 + 2 * 4
    assert padding_efficiency(sum(lengths), padded_tokens([[0, 1], [2, 3]], lengths)) == pytest.approx(19 / 28)
    assert padding_efficiency(0, 0) == 1.0


def test_attention_pairs_are_the_causal_triangle_of_each_sequence():
    assert attention_pairs([1, 3]) == 1 + 6
    mask = torch.ones(3, 3).tril()
    assert attention_pairs([3]) == int(mask.sum())
