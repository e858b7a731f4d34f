from __future__ import annotations

import pytest

from dflash_queue.engines.layers import dflash_layer_ids, eagle3_layer_ids, resolve_layer_ids


@pytest.mark.parametrize(
    "num_layers, k, expected",
    [
        (36, 5, [1, 9, 17, 25, 33]),
        (64, 5, [1, 16, 31, 46, 61]),
        (36, 1, [18]),
        (6, 3, [1, 2, 3]),
        (28, 2, [1, 25]),
    ],
)
def test_dflash_rule(num_layers, k, expected):
    assert dflash_layer_ids(num_layers, k) == expected


def test_eagle3_rule():
    assert eagle3_layer_ids(36) == [1, 17, 32]


def test_explicit_ids_win_and_are_checked():
    assert resolve_layer_ids((2, 4), 36, 5) == [2, 4]
    assert resolve_layer_ids((), 36, 5) == [1, 9, 17, 25, 33]
    with pytest.raises(ValueError, match=r"\[40\] do not exist"):
        resolve_layer_ids((1, 40), 36, 5)
    with pytest.raises(ValueError, match="cannot spread"):
        dflash_layer_ids(6, 5)
