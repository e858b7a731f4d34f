"""The suite's grouping over test processes (dfq_testing/scheduling.py)."""

from __future__ import annotations

from pathlib import Path

from dfq_testing.scheduling import LONGEST_FIRST, SPLIT_BY_FAMILY, group_of

REPO = Path(__file__).resolve().parents[2]


def test_a_modules_tests_share_a_group_and_split_modules_split_by_family():
    assert group_of("tests/ops/test_status.py::test_a[x-y]") == group_of("tests/ops/test_status.py::test_b")
    conformance = "tests/test_conformance.py"
    assert group_of(f"{conformance}::test_stored[qwen3_5_moe-float32]") == f"{conformance}[qwen3_5_moe]"
    assert group_of(f"{conformance}::test_generate[qwen3_5_moe]") == f"{conformance}[qwen3_5_moe]"
    assert group_of(f"{conformance}::test_stored[qwen3-float32]") != group_of(f"{conformance}::test_stored[llama-float32]")
    assert group_of(f"{conformance}::test_unparametrized") == conformance


def test_the_lists_name_modules_that_exist():
    """A module renamed or removed would silently lose its place (or its split)."""
    for module in {*LONGEST_FIRST, *SPLIT_BY_FAMILY}:
        assert (REPO / module).is_file(), module
