"""vLLM's model in its engine core's process (vLLM's uniprocess executor), for tests that check what an engine
computes."""

from __future__ import annotations

import gc
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import psutil
import pytest

MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"
# The name vLLM's multiprocess executor gives each model worker process (vllm.utils.system_utils.set_process_title).
MODEL_WORKER_TITLE = "VLLM::Worker"


def model_workers(processes: Iterable[psutil.Process]) -> list[psutil.Process]:
    """The model worker processes among `processes`: none where the model runs in the engine core's process."""
    return [p for p in processes if p.name().startswith(MODEL_WORKER_TITLE)]


@contextmanager
def uniproc_executor() -> Iterator[None]:
    """Engines created inside run their model in the engine core's process, as vLLM does on a GPU with one rank.

    The product's engines are `AsyncLLM`s, whose engine core always runs in a process of its own. On the CPU,
    vLLM's platform switches the uniprocess executor to its multiprocess one (a model worker in a third process)
    unless VLLM_ENABLE_V1_MULTIPROCESSING is 0 (`CpuPlatform.check_and_update_config`), which this sets: one
    process importing vLLM less per engine start, about 12 core-seconds on the 2-core dev machine. An engine may
    outlive the block. tests/engines/vllm/test_vllm_generate.py, the tensor-parallel tests, `run` on the vLLM extract
    engine, the shipped CPU configs and the doctor's keep the CPU build's own layout."""
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv(MULTIPROCESSING_ENV, "0")
            yield
    finally:
        # An engine core that ran in the calling process (vLLM's own `LLM` with the variable at 0) cached vLLM's
        # environment and froze the garbage collector's heap: engines started after the block read the environment
        # afresh, and what the block left is collectable.
        import vllm.envs

        vllm.envs.disable_envs_cache()
        gc.unfreeze()
