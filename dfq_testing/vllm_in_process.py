"""vLLM's engine core in the calling process, for tests that check what an engine computes."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


@contextmanager
def engine_core_in_this_process() -> Iterator[None]:
    """Engines created inside run their engine core in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0): on the
    2-core dev machine a start costs 8 s and 8 core-seconds instead of 20 s and 20 (vLLM imported once, not in
    three processes). An engine may outlive the block. Deployments run the engine core and its model worker in
    processes of their own; the worker, `run`, tensor-parallel and engine-lifecycle tests keep that layout."""
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(MULTIPROCESSING_ENV, "0")
            yield
    finally:
        # An engine core started here cached vLLM's environment variables and froze the garbage collector's heap:
        # engines started after the block read the environment afresh, and what the block left is collectable.
        import vllm.envs

        vllm.envs.disable_envs_cache()
        gc.unfreeze()
