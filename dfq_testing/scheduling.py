"""How the suite's tests are spread over pytest-xdist's processes (`-n 2 --dist loadgroup`, pyproject.toml).

A module's tests stay in one process, so its module-scoped engines start once; modules that need one of the
session's expensive servers share a group, so the servers start once. A module may split itself by one of its
parameters (`XDIST_SPLIT_BY = "name"`: one group per model family) where each value sets up its own engines
anyway. The longest groups are sent first, so that no long one starts last and runs alone: xdist hands out groups
in the order they come (`--no-loadscope-reorder`), to whichever process is free.
"""

from __future__ import annotations

import pytest

# Session fixtures whose users share one group (started once per process that needs them).
SHARED_FIXTURES = ("vllm_servers",)
# The longest modules, longest first (wall time on the 2-core dev machine, 2026-12-05); the rest follow in
# collection order.
LONGEST_FIRST = (
    "tests/test_conformance.py",
    "tests/test_end_to_end_vllm_extract.py",
    "tests/engines/test_vllm_extract_bfloat16.py",
    "vllm_servers",
    "tests/test_end_to_end_vllm.py",
    "tests/tools/test_gpu_check.py",
    "tests/cli/test_common.py",
    "tests/test_end_to_end.py",
    "tests/ops/test_planner.py",
    "tests/audit/test_audit.py",
    "tests/lanes/test_extract_checks.py",
    "tests/test_single_box.py",
    "tests/training/test_dataset.py",
    "tests/exports/test_exports.py",
    "tests/live/test_live_run.py",
    "tests/tools/test_bench_extract.py",
    "tests/faults/test_kill.py",
)


def group_of(item: pytest.Item) -> str:
    for fixture in SHARED_FIXTURES:
        if fixture in getattr(item, "fixturenames", ()):
            return fixture
    module = item.nodeid.split("::", 1)[0]
    split_by = getattr(getattr(item, "module", None), "XDIST_SPLIT_BY", None)
    callspec = getattr(item, "callspec", None)
    if split_by and callspec is not None and split_by in callspec.params:
        return f"{module}[{callspec.params[split_by]}]"
    return module


def _rank(group: str) -> int:
    base = group.split("[", 1)[0]
    return LONGEST_FIRST.index(base) if base in LONGEST_FIRST else len(LONGEST_FIRST)


def group_and_order(items: list[pytest.Item]) -> None:
    """Mark each test with its xdist group and put the groups in the order they should be handed out (stable:
    within a group, and among the rest, the collection order stays)."""
    groups = {id(item): group_of(item) for item in items}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(groups[id(item)]))
    first_seen: dict[str, int] = {}
    for position, item in enumerate(items):
        first_seen.setdefault(groups[id(item)], position)
    items.sort(key=lambda item: (_rank(groups[id(item)]), first_seen[groups[id(item)]]))

