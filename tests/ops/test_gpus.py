from __future__ import annotations

import pytest

from dflash_queue.ops.gpus import (
    instance_name,
    parse_gpu_group,
    parse_gpu_groups,
    parse_gpu_list,
    visible_devices,
)


def test_instance_names_are_gpu_lists_joined_by_dashes():
    assert parse_gpu_group("0") == (0,)
    assert parse_gpu_group("0-1") == (0, 1)
    assert parse_gpu_group("0-3") == (0, 3)  # a list, not a range
    assert parse_gpu_group("0,2") == (0, 2)
    assert visible_devices(parse_gpu_group("4-5-6-7")) == "4,5,6,7"
    assert instance_name((0, 1)) == "0-1"


@pytest.mark.parametrize("bad", ["", "a", "0--1", "-1", "0-0", "0-1-", "GPU-5c3f"])
def test_bad_groups_are_refused_with_the_group_named(bad):
    with pytest.raises(ValueError, match="GPU group"):
        parse_gpu_group(bad)


def test_several_workers_and_node_gpus():
    assert parse_gpu_groups("0-1,2-3") == ((0, 1), (2, 3))
    assert parse_gpu_groups("4,5") == ((4,), (5,))
    with pytest.raises(ValueError, match="empty group"):
        parse_gpu_groups("0,,1")
    assert parse_gpu_list("4") == (0, 1, 2, 3)
    assert parse_gpu_list("0,2,5") == (0, 2, 5)
    with pytest.raises(ValueError, match="count"):
        parse_gpu_list("x")
