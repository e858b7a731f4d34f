"""How the suite's tests are spread over pytest-xdist's processes (`pytest -n N --no-loadscope-reorder`).

A module's tests stay in one process, so its module-scoped engines and servers start once. The modules that run
one model family per parameter (`SPLIT_BY_FAMILY`: the family is the first part of the test's parameter id) are
split by family, since each family starts its own models anyway. The longest groups go first (`LONGEST_FIRST`),
so that no long one starts last and runs alone: groups are handed out in collection order, to whichever process
is free.

The groups are computed from node ids in the controller (`GroupScheduling`), which does not collect: xdist's
own `xdist_group` marks rename node ids, which pytest 9.2's nodes no longer allow.
"""

from __future__ import annotations

import pytest
from xdist.scheduler import LoadScopeScheduling

SPLIT_BY_FAMILY = (
    "tests/test_conformance.py",
    "tests/test_end_to_end_vllm_extract.py",
    "tests/engines/vllm/test_vllm_extract_bfloat16.py",
)
# The longest modules, longest first (wall time in one process on the 2-core dev machine, 2026-12-05); the rest
# follow in collection order.
LONGEST_FIRST = (
    "tests/test_end_to_end_faults.py",
    "tests/test_end_to_end_vllm_extract.py",
    "tests/test_end_to_end_suspects.py",
    "tests/tools/test_gpu_check.py",
    "tests/engines/server/test_server_generate.py",
    "tests/test_end_to_end_vllm.py",
    "tests/test_end_to_end.py",
    "tests/live/test_live_run.py",
    "tests/queue/test_heartbeat.py",
    "tests/tools/test_bench_extract.py",
    "tests/tools/test_soak.py",
    "tests/engines/vllm/test_vllm_extract_bfloat16.py",
    "tests/engines/test_canary_trained.py",
    "tests/dfq_testing/test_connector_faults.py",
    "tests/faults/test_kill.py",
    "tests/test_single_box.py",
    "tests/test_end_to_end_vllm_tensor_parallel.py",
    "tests/engines/test_engines_agree.py",
    "tests/ops/test_planner.py",
    "tests/engines/vllm/test_vllm_generate.py",
    "tests/doctor/test_extract_states.py",
    "tests/faults/test_canary.py",
    "tests/test_reextract.py",
    "tests/test_end_to_end_s3.py",
    "tests/audit/test_audit.py",
    "tests/live/test_live_under_run.py",
    "tests/test_conformance.py",
)


def group_of(nodeid: str) -> str:
    """The group a test runs in: its module, or its module and model family for the modules split by family."""
    module, _, rest = nodeid.partition("::")
    if module in SPLIT_BY_FAMILY and rest.endswith("]") and "[" in rest:
        family = rest[rest.index("[") + 1 : -1].split("-", 1)[0]
        return f"{module}[{family}]"
    return module


def _rank(module: str) -> int:
    return LONGEST_FIRST.index(module) if module in LONGEST_FIRST else len(LONGEST_FIRST)


def order_longest_first(items: list[pytest.Item]) -> None:
    """The longest modules first, each module's tests together, the rest in collection order (a stable sort)."""
    items.sort(key=lambda item: _rank(item.nodeid.partition("::")[0]))


class GroupScheduling(LoadScopeScheduling):
    """xdist's module-scope scheduling with `group_of` as the scope."""

    def _split_scope(self, nodeid: str) -> str:
        return group_of(nodeid)
