"""One resident vLLM async engine, driven from an event loop in a thread of its own: what both lanes' vLLM
engines share (start, health, throughput logs, shutdown, the engine arguments common to both, token prompts).

The engine is vLLM's `AsyncLLM`. Its model runs in processes vLLM starts (the engine core and its workers, one
per GPU of a tensor-parallel group); this process only submits requests and collects outputs. Any number of
task threads may wait on it at once: their coroutines interleave on the one loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from typing import Any, TypeVar

from dflash_queue.config import Config
from dflash_queue.engines.config import VllmEngineSettings
from dflash_queue.engines.loop_thread import EventLoopThread
from dflash_queue.errors import EngineUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

# How often a waiting call checks that the engine is still alive, and how long it waits for aborts.
ENGINE_CHECK_INTERVAL_S = 1.0
ABORT_WAIT_S = 5.0


def common_engine_args(config: Config, settings: VllmEngineSettings) -> dict[str, Any]:
    """`AsyncEngineArgs` keywords both lanes set the same way from their `vllm` section, engine_args included."""
    args: dict[str, Any] = {
        "model": config.model.path,
        "tokenizer": config.model.tokenizer_path,
        "served_model_name": config.model.display_name,
        "dtype": settings.dtype or config.model.dtype,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "max_num_seqs": settings.max_num_seqs,
        "enforce_eager": settings.enforce_eager,
        "disable_log_stats": settings.log_stats_interval_s == 0,
    }
    if settings.max_model_len:
        args["max_model_len"] = settings.max_model_len
    if settings.max_num_batched_tokens:
        args["max_num_batched_tokens"] = settings.max_num_batched_tokens
    if settings.kv_cache_memory_gib:
        args["kv_cache_memory_bytes"] = int(settings.kv_cache_memory_gib * 2**30)
    if is_multimodal(config.model.path):
        # Prompts here are text: no image or video inputs, so vLLM neither profiles nor reserves memory for them.
        args["language_model_only"] = True
    # Checked when the config loaded: none of them is a key set above or by a lane (vllm_args refuses those).
    args.update(settings.engine_args)
    return args


def is_multimodal(model_path: str) -> bool:
    from dflash_queue.engines.decoder import read_layout

    try:
        return read_layout(model_path).multimodal
    except (OSError, ValueError):  # not a local checkpoint: let vLLM resolve it
        return False


def prepare_environment(settings: VllmEngineSettings) -> None:
    """Environment vLLM reads at start-up; must run before its engine is created."""
    os.environ.update(settings.env)
    # vLLM starts its engine processes from this process, which already runs threads (Celery's consumer, the
    # engine's event loop): forking it could copy a held lock into the child. Spawn starts them clean, and
    # never inherits a CUDA context either.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def token_prompt(engine: Any, prompt_ids: list[int]) -> Any:
    """An engine input made of exactly these token ids, rendered the way vLLM's own `LLM.generate` does."""
    from vllm import TokensPrompt
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    parsed = parse_model_prompt(engine.model_config, TokensPrompt(prompt_token_ids=list(prompt_ids)))
    (rendered,) = engine.renderer.render_cmpl([parsed], engine.renderer.default_cmpl_tok_params)
    return rendered


class ResidentVllmEngine:
    """An `AsyncLLM` started once from `engine_args`, with the loop that drives it."""

    def __init__(self, engine_args: dict[str, Any], settings: VllmEngineSettings, loop_name: str) -> None:
        from vllm import AsyncEngineArgs

        self.settings = settings
        self._stats_task: asyncio.Task | None = None
        self._loop = EventLoopThread(loop_name)
        try:
            self.engine: Any = self._loop.run(self._start(AsyncEngineArgs(**engine_args)))
        except BaseException:
            self._loop.stop()
            raise

    async def _start(self, args: Any) -> Any:
        # Created on the loop thread, so that its output handler runs on this loop.
        from vllm import AsyncLLMEngine

        engine = AsyncLLMEngine.from_engine_args(args)
        if self.settings.log_stats_interval_s:
            self._stats_task = asyncio.get_running_loop().create_task(self._log_stats(engine))
        return engine

    async def _log_stats(self, engine: Any) -> None:
        while True:
            await asyncio.sleep(self.settings.log_stats_interval_s)
            await engine.do_log_stats()

    @property
    def closed(self) -> bool:
        return self.engine is None

    def run(self, coroutine: Coroutine[Any, Any, T]) -> T:
        """Run `coroutine` on the engine's loop and wait for its result; refused once the engine is closed."""
        if self.engine is None:
            coroutine.close()
            raise EngineUnavailable("the vLLM engine is closed")
        return self._loop.run(coroutine)

    def submit(self, coroutine: Coroutine[Any, Any, T]) -> asyncio.Future[T] | Any:
        """Start `coroutine` on the loop without waiting (a concurrent.futures.Future)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop.loop)

    async def gather_checked(self, tasks: list[asyncio.Task[T]], what: str) -> list[T]:
        """Wait for every task; the first failure cancels the rest. vLLM does not wake every waiter when its
        engine process dies (a request added at that moment waits forever), so the engine's health is looked at
        while waiting instead of trusting every request to end."""
        engine = self.engine
        try:
            pending = set(tasks)
            while pending:
                done, pending = await asyncio.wait(
                    pending, timeout=ENGINE_CHECK_INTERVAL_S, return_when=asyncio.FIRST_EXCEPTION
                )
                for task in done:
                    error = task.exception()
                    if error is not None:
                        raise error
                if pending and engine.errored:
                    raise EngineUnavailable(f"the vLLM engine died while {what}")
            return [task.result() for task in tasks]
        finally:
            # A failed request takes its siblings down: they are aborted in the engine. A dead engine may never
            # confirm an abort, so do not wait for that for long.
            unfinished = [task for task in tasks if not task.done()]
            for task in unfinished:
                task.cancel()
            if unfinished:
                await asyncio.wait(unfinished, timeout=ABORT_WAIT_S)

    def close(self) -> None:
        """Shut the engine down (its processes exit, or are killed after shutdown_timeout_s) and stop the loop."""
        engine, self.engine = self.engine, None
        if engine is None:
            return
        try:
            # Stop reading outputs first, so that the engine processes exiting is not reported as a failure.
            self._loop.run(self._stop_background(engine))
            engine.shutdown(timeout=self.settings.shutdown_timeout_s)
        finally:
            self._loop.stop(timeout=ABORT_WAIT_S)

    async def _stop_background(self, engine: Any) -> None:
        tasks = [task for task in (self._stats_task, getattr(engine, "output_handler", None)) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
