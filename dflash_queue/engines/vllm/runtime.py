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
import re
import stat
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

from dflash_queue.engines.config import ModelConfig, VllmEngineSettings
from dflash_queue.engines.loop_thread import EventLoopThread
from dflash_queue.engines.vllm import host as vllm_host
from dflash_queue.errors import EngineStartFailed, EngineUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")

# How often a waiting call checks that the engine is still alive, and how long it waits for aborts.
ENGINE_CHECK_INTERVAL_S = 1.0
ABORT_WAIT_S = 5.0


def common_engine_args(model: ModelConfig, settings: VllmEngineSettings) -> dict[str, Any]:
    """`AsyncEngineArgs` keywords both lanes set the same way from their `vllm` section, engine_args included."""
    args: dict[str, Any] = {
        "model": model.path,
        "tokenizer": model.tokenizer_path,
        "served_model_name": model.display_name,
        "dtype": settings.dtype or model.dtype,
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
    if is_multimodal(model.path):
        # Prompts here are text: no image or video inputs, so vLLM neither profiles nor reserves memory for them.
        args["language_model_only"] = True
    # Checked when the config loaded: none of them is a key set above or by a lane (engines/engine_args.py refuses those).
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
    vllm_host.bind_rank_threads(settings)


# ---------------------------------------------------------------------------------------------------------------
# Why an engine did not start

# vLLM's engine processes write to this process's stdout and stderr, each line behind "(EngineCore pid=N) " and
# colour codes; their exceptions reach this process only as "Engine core initialization failed. See root cause
# above."
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PROCESS_PREFIX = re.compile(r"^\((?:[\w.-]+ )?pid=\d+\) ?")
# vLLM's log records: "ERROR 12-05 10:00:31 [core.py:1510] " before each line of a logged traceback.
_RECORD_PREFIX = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] ")
_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Interrupt|Exit|Failure|Refused)\b(?::.*)?$")


class OutputMark:
    """Where this process's stdout and stderr end now, when they are files (as under `dflash-queue run` and the
    tests), so that what vLLM's processes wrote after it can be read back (a terminal, a pipe or the journal
    cannot be: nothing is marked then)."""

    def __init__(self) -> None:
        self.ends: dict[tuple[int, int], tuple[int, int]] = {}  # (device, inode) -> (fd, size now)
        for fd in (1, 2):
            try:
                info = os.fstat(fd)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                self.ends.setdefault((info.st_dev, info.st_ino), (fd, info.st_size))

    def written_since(self, limit: int = 4 << 20) -> list[str]:
        lines: list[str] = []
        for fd, start in self.ends.values():
            try:  # a file of its own through /proc: the fd's offset is left alone, a deleted file still read
                with open(f"/proc/self/fd/{fd}", "rb") as out:
                    out.seek(start)
                    lines += out.read(limit).decode(errors="replace").splitlines()
            except OSError:
                continue
        return lines


def root_cause(lines: Iterable[str]) -> str | None:
    """The first exception a traceback in `lines` ends with ("ValueError: ..."), vLLM's process and log-record
    prefixes and colour codes taken off; else the first line that looks like one; None without either."""
    cleaned = [_RECORD_PREFIX.sub("", _PROCESS_PREFIX.sub("", _ANSI.sub("", line))).rstrip() for line in lines]
    in_traceback = False
    for line in cleaned:
        if line.startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and line and not line[0].isspace():
            return line
    return next((line for line in cleaned if _EXCEPTION_LINE.match(line)), None)


def token_prompt(engine: Any, prompt_ids: list[int]) -> Any:
    """An engine input made of exactly these token ids, rendered the way vLLM's own `LLM.generate` does."""
    from vllm import TokensPrompt
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    parsed = parse_model_prompt(engine.model_config, TokensPrompt(prompt_token_ids=list(prompt_ids)))
    (rendered,) = engine.renderer.render_cmpl([parsed], engine.renderer.default_cmpl_tok_params)
    return rendered


class ResidentVllmEngine:
    """An `AsyncLLM` started once from `engine_args`, with the loop that drives it."""

    def __init__(
        self, engine_args: dict[str, Any], settings: VllmEngineSettings, loop_name: str, *, in_flight: int = 0
    ) -> None:
        """`in_flight`: the sequences the lane keeps in the engine (default max_num_seqs), which a CPU device's KV
        cache is sized for when none is set (engines/vllm/host.py)."""
        from vllm import AsyncEngineArgs

        self.settings = settings
        self._stats_task: asyncio.Task | None = None
        engine_args = dict(engine_args)
        vllm_host.size_cpu_kv_cache(engine_args, settings, in_flight=in_flight)
        self._loop = EventLoopThread(loop_name)
        mark = OutputMark()
        try:
            self.engine: Any = self._loop.run(self._start(AsyncEngineArgs(**engine_args)))
        except Exception as exc:
            self._loop.stop()
            # An engine process's failure reaches this process as "... See root cause above.": that cause is in
            # what the process wrote; anything else was raised here and says itself why.
            cause = root_cause(mark.written_since()) if "root cause" in str(exc) else None
            raise EngineStartFailed(
                f"the vLLM {vllm_host.lane_of(settings)} engine did not start: "
                f"{cause or f'{type(exc).__name__}: {exc}'}"
            ) from exc
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
