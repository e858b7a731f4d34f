from __future__ import annotations

import pytest

from dflash_queue.engines.layers import (
    captured_entries,
    dflash_layer_ids,
    eagle3_layer_ids,
    resolve_layer_ids,
    vllm_aux_ids_of_entries,
    vllm_aux_layer_ids,
)


@pytest.mark.parametrize(
    "num_layers, k, expected",
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (64, 5, [1, 16, 31, 46, 61]),
        (36, 1, [18]),
        (6, 3, [1, 2, 3]),
        (28, 2, [1, 25]),
        # Ties go to the even integer, as Python's round does in DFlash's build_target_layer_ids.
        (94, 5, [1, 24, 46, 68, 91]),  # 68.5 -> 68
        (62, 5, [1, 16, 30, 44, 59]),  # 15.5 -> 16, 44.5 -> 44
        (11, 3, [1, 4, 8]),  # 4.5 -> 4
        (13, 3, [1, 6, 10]),  # 5.5 -> 6
    ],
)
def test_dflash_rule(num_layers, k, expected):
    assert dflash_layer_ids(num_layers, k) == expected


def test_dflash_rule_equals_the_release_formula_everywhere():
    """The release's own expression, written out, over every model depth and K a drafter would use."""
    for num_layers in range(6, 130):
        for k in range(2, 9):
            if num_layers - 3 < k:
                continue
            release = [int(round(1 + i * (num_layers - 4) / (k - 1))) for i in range(k)]
            assert dflash_layer_ids(num_layers, k) == release, (num_layers, k)


def test_eagle3_rule():
    assert eagle3_layer_ids(36) == [1, 17, 32]


def test_explicit_ids_win_and_are_checked():
    assert resolve_layer_ids((2, 4), 36, 5) == [2, 4]
    assert resolve_layer_ids((), 36, 5) == [1, 9, 17, 25, 33]
    with pytest.raises(ValueError, match=r"\[40\] do not exist"):
        resolve_layer_ids((1, 40), 36, 5)
    with pytest.raises(ValueError, match="cannot spread"):
        dflash_layer_ids(6, 5)


def test_stored_entries_are_the_layers_then_the_last_layer_before_and_after_the_norm():
    assert captured_entries([5, 1], 64) == [(5, "decoder_output"), (1, "decoder_output")]
    assert captured_entries([5, 1], 64, last_layer_state=True, final_norm_state=True) == [
        (5, "decoder_output"), (1, "decoder_output"), (63, "last_layer"), (63, "final_norm")
    ]


def test_decoder_layer_i_is_vllms_aux_layer_i_plus_one_and_the_last_layer_is_aux_layer_n():
    entries = captured_entries([0, 61, 16], 64, last_layer_state=True, final_norm_state=True)
    assert vllm_aux_ids_of_entries(entries, 64) == [1, 62, 17, 64, 64]
    assert vllm_aux_ids_of_entries(captured_entries([63], 64, final_norm_state=True), 64) == [64, 64]


def test_vllms_aux_layers_are_distinct_and_ascending():
    # Decoder layer i's output is aux layer i + 1; the last layer and the final-norm entry read aux layer N (64).
    assert vllm_aux_layer_ids(captured_entries([61, 0, 16], 64), 64) == [1, 17, 62]
    assert vllm_aux_layer_ids(captured_entries([61, 0, 16], 64, final_norm_state=True), 64) == [1, 17, 62, 64]
    both = captured_entries([63], 64, last_layer_state=True, final_norm_state=True)
    assert vllm_aux_layer_ids(both, 64) == [64]  # one cached layer for three entries
