"""The block that keeps vLLM's model in its engine core's process leaves nothing of itself behind: the environment
as it was, vLLM's environment cache off and the garbage collector's heap unfrozen, as an engine core started in
the calling process leaves them (EngineCore.__init__ calls enable_envs_cache and freeze_gc_heap). That an engine
started in the block runs no model worker of its own is checked where one starts (tests/engines/vllm/test_vllm_extract.py)."""

from __future__ import annotations

import gc
import os

import pytest

from dfq_testing.vllm_uniproc import MULTIPROCESSING_ENV, uniproc_executor


@pytest.mark.parametrize("before", [None, "1"])
def test_the_block_restores_the_environment_and_undoes_what_an_engine_core_did(before, monkeypatch):
    import vllm.envs

    if before is None:
        monkeypatch.delenv(MULTIPROCESSING_ENV, raising=False)
    else:
        monkeypatch.setenv(MULTIPROCESSING_ENV, before)
    with uniproc_executor():
        assert vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING is False
        vllm.envs.enable_envs_cache()  # what an engine core started here does
        gc.freeze()
    try:
        assert os.environ.get(MULTIPROCESSING_ENV) == before
        assert not vllm.envs._is_envs_cache_enabled()
        assert vllm.envs.VLLM_ENABLE_V1_MULTIPROCESSING is True  # read afresh
        assert gc.get_freeze_count() == 0
    finally:
        vllm.envs.disable_envs_cache()
        gc.unfreeze()
