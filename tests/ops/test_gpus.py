from __future__ import annotations

import os

import pytest

from dflash_queue.ops.gpus import (
    NodeGpus,
    instance_name,
    missing_gpus_error,
    node_gpus,
    parse_gpu_group,
    parse_gpu_groups,
    parse_gpu_list,
    visible_devices,
)
from dfq_testing.gpus import fake_nvidia_smi


def test_a_group_is_ranges_and_single_gpus():
    assert parse_gpu_group("0") == (0,)
    assert parse_gpu_group("0-1") == (0, 1)
    assert parse_gpu_group("0-3") == (0, 1, 2, 3)  # a range, not GPUs 0 and 3
    assert parse_gpu_group("0,2") == (0, 2)
    assert parse_gpu_group("0_2") == (0, 2)  # the systemd instance form of a list
    assert parse_gpu_group("0-1,4-5") == (0, 1, 4, 5)
    assert visible_devices(parse_gpu_group("4-7")) == "4,5,6,7"


@pytest.mark.parametrize("group", [(0,), (0, 1), (0, 1, 2, 3), (0, 2), (0, 1, 4, 5), (3, 1), (4, 5, 6, 7)])
def test_instance_names_read_back_as_the_same_group(group):
    assert parse_gpu_group(instance_name(group)) == group
    assert "," not in instance_name(group)  # systemd unit names cannot hold one
    assert parse_gpu_groups(instance_name(group)) == (group,)


def test_instance_names_are_ranges_where_they_can_be():
    assert instance_name((0, 1, 2, 3, 4, 5, 6, 7)) == "0-7"
    assert instance_name((0, 2)) == "0_2"
    assert instance_name((0, 1, 4, 5)) == "0-1_4-5"


@pytest.mark.parametrize("bad", ["", "a", "0--1", "-1", "0-0", "3-1", "0-1-", "GPU-5c3f", "0,,1", "1,1", "0-2,1"])
def test_bad_groups_are_refused_with_the_group_named(bad):
    with pytest.raises(ValueError, match="GPU group"):
        parse_gpu_group(bad)


def test_a_chain_of_dashes_is_refused_with_both_readings():
    """The old instance form (0-1-2-3 for GPUs 0 to 3) is neither a range nor a list now: refused, saying how to
    write each."""
    with pytest.raises(ValueError, match=r"a range is FIRST-LAST: 4-7 is GPUs 4 to 7, 4,5,6,7 lists them"):
        parse_gpu_group("4-5-6-7")


def test_several_workers_and_node_gpus():
    assert parse_gpu_groups("0-1,2-3") == ((0, 1), (2, 3))
    assert parse_gpu_groups("4,5") == ((4,), (5,))
    assert parse_gpu_groups("0-3,4-7") == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert parse_gpu_groups("0_2,1_3") == ((0, 2), (1, 3))
    with pytest.raises(ValueError, match="empty group"):
        parse_gpu_groups("0,,1")
    assert parse_gpu_list("4") == (0, 1, 2, 3)
    assert parse_gpu_list("0,2,5") == (0, 2, 5)
    assert parse_gpu_list("0-3") == (0, 1, 2, 3)
    with pytest.raises(ValueError, match="count"):
        parse_gpu_list("x")


def test_indices_the_node_does_not_have_are_named():
    two = NodeGpus(2, "nvidia-smi")
    assert missing_gpus_error((0, 1), two) is None
    assert missing_gpus_error((0, 1, 2, 3), two) == "GPU 2, 3 not on this node: it has 2 (GPUs 0-1, from nvidia-smi)"
    assert "this node has no GPU (torch.cuda.device_count() finds none)" in missing_gpus_error(
        (0,), NodeGpus(0, "torch.cuda.device_count()")
    )


def test_the_node_count_comes_from_nvidia_smi_where_there_is_one(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path, 3)}{os.pathsep}{os.environ['PATH']}")
    assert node_gpus() == NodeGpus(3, "nvidia-smi")


def test_without_nvidia_tools_torch_counts_the_gpus(monkeypatch, tmp_path):
    """This machine: no nvidia-smi, no NVIDIA driver, a CPU build of torch."""
    import shutil

    import torch

    if shutil.which("nvidia-smi") or os.path.isdir("/proc/driver/nvidia/gpus"):
        pytest.skip("a GPU node: nvidia-smi or the driver answers first")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the count is the node's, not what this process may see
    assert node_gpus() == NodeGpus(torch.cuda.device_count(), "torch.cuda.device_count()")
