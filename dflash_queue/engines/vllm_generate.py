"""Generation with one resident vLLM async engine, fed by several task threads at once.

Each `generate` call submits its requests to the shared engine and waits for its own results. Calls from
different threads overlap, so while one shard's slowest sequences finish, the other shards' requests take the
freed slots: the engine never drains at a task boundary (see `generate.vllm.inflight_tasks`).

The engine is vLLM's `AsyncLLM`, driven from an event loop in a thread of its own. Its model runs in processes
vLLM starts (the engine core and its workers); this process only submits requests and collects outputs.
Prompt ids go in as token prompts; prompt ids, completion ids and finish reasons are taken from vLLM's own
`RequestOutput`, never re-tokenised.
"""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import logging
import os
from collections.abc import Sequence
from typing import Any

from dflash_queue.config import Config, SamplingConfig
from dflash_queue.engines.base import Generation, GenerationRequest
from dflash_queue.engines.loop_thread import EventLoopThread
from dflash_queue.errors import ConfigError, EngineUnavailable, GenerationRejected

log = logging.getLogger(__name__)

# How often a waiting call checks that the engine is still alive, and how long it waits for aborts.
ENGINE_CHECK_INTERVAL_S = 1.0
ABORT_WAIT_S = 5.0


def engine_args(config: Config) -> dict[str, Any]:
    """vLLM engine arguments (`AsyncEngineArgs` keywords) from the config."""
    settings = config.generate.vllm
    args: dict[str, Any] = {
        "model": config.model.path,
        "tokenizer": config.model.tokenizer_path,
        "served_model_name": config.model.display_name,
        "dtype": settings.dtype or config.model.dtype,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "max_num_seqs": settings.max_num_seqs,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "enable_chunked_prefill": settings.enable_chunked_prefill,
        "enforce_eager": settings.enforce_eager,
        "seed": settings.seed,
        "disable_log_stats": settings.log_stats_interval_s == 0,
    }
    if settings.max_model_len:
        args["max_model_len"] = settings.max_model_len
    if settings.max_num_batched_tokens:
        args["max_num_batched_tokens"] = settings.max_num_batched_tokens
    if settings.kv_cache_memory_gib:
        args["kv_cache_memory_bytes"] = int(settings.kv_cache_memory_gib * 2**30)
    if _is_multimodal(config.model.path):
        # Prompts here are text: no image or video inputs, so vLLM neither profiles nor reserves memory for them.
        args["language_model_only"] = True
    return args


def _is_multimodal(model_path: str) -> bool:
    from dflash_queue.engines.decoder import read_layout

    try:
        return read_layout(model_path).multimodal
    except (OSError, ValueError):  # not a local checkpoint: let vLLM resolve it
        return False


def request_seed(base_seed: int, sample_id: str, attempt: int = 0) -> int:
    """The sampling seed of one request: fixed per sample (a re-delivered task regenerates the same reply),
    unrelated between samples (one shared seed would make every reply draw the same random numbers), and new
    for a quality-gate retry (which must be sampled afresh, not replayed)."""
    key = f"{base_seed}:{sample_id}" + (f"#{attempt}" if attempt else "")
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


def sampling_kwargs(sampling: SamplingConfig, request: GenerationRequest) -> dict[str, Any]:
    """`SamplingParams` keywords for one request (without the output kind)."""
    return {
        "n": 1,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k if sampling.top_k > 0 else 0,
        "min_p": sampling.min_p,
        "repetition_penalty": sampling.repetition_penalty,
        "max_tokens": request.max_tokens or sampling.max_tokens,
        "stop": list(sampling.stop) or None,
        "seed": request_seed(sampling.seed, request.sample_id, request.attempt),
        # Keep <think> and friends in the decoded text, as the Transformers engine does.
        "skip_special_tokens": False,
    }


def _token_prompt(engine, prompt_ids: list[int]):
    """An engine input made of exactly these token ids, rendered the way vLLM's own `LLM.generate` does."""
    from vllm import TokensPrompt
    from vllm.renderers.inputs.preprocess import parse_model_prompt

    parsed = parse_model_prompt(engine.model_config, TokensPrompt(prompt_token_ids=list(prompt_ids)))
    (rendered,) = engine.renderer.render_cmpl([parsed], engine.renderer.default_cmpl_tok_params)
    return rendered


def check_platform(config: Config) -> None:
    """Settings the installed vLLM build cannot run with; fails before any engine process starts."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and config.generate.vllm.enable_chunked_prefill:
        # Every request carries a seed; after a partial prefill vLLM rewinds that request's random generator,
        # which only CUDA generators support.
        raise ConfigError(
            f"{config.source}: generate.vllm.enable_chunked_prefill must be false with vLLM's CPU build "
            "(it cannot rewind a seeded request's generator after a partial prefill)"
        )


def prepare_environment(config: Config) -> None:
    """Environment vLLM reads at start-up; must run before its engine is created."""
    os.environ.update(config.generate.vllm.env)
    # vLLM starts its engine processes from this process, which already runs threads (Celery's consumer, the
    # engine's event loop): forking it could copy a held lock into the child. Spawn starts them clean, and
    # never inherits a CUDA context either.
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


class VllmGenerateEngine:
    name = "vllm"

    def __init__(self, config: Config) -> None:
        self.sampling: SamplingConfig = config.generate.sampling
        self.settings = config.generate.vllm
        prepare_environment(config)
        check_platform(config)
        # Imported here: vLLM is optional and slow to import; the Transformers engine never needs it.
        from vllm import AsyncEngineArgs, SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._sampling_params = SamplingParams
        self._final_only = RequestOutputKind.FINAL_ONLY
        self._request_ids = itertools.count()
        self._stats_task: asyncio.Task | None = None
        self._loop = EventLoopThread("vllm-engine-loop")
        try:
            self._engine = self._loop.run(self._start(AsyncEngineArgs(**engine_args(config))))
        except BaseException:
            self._loop.stop()
            raise

    async def _start(self, args) -> Any:
        # Created on the loop thread, so that its output handler runs on this loop.
        from vllm import AsyncLLMEngine

        engine = AsyncLLMEngine.from_engine_args(args)
        if self.settings.log_stats_interval_s:
            self._stats_task = asyncio.get_running_loop().create_task(self._log_stats(engine))
        return engine

    async def _log_stats(self, engine) -> None:
        while True:
            await asyncio.sleep(self.settings.log_stats_interval_s)
            await engine.do_log_stats()

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """One generation per request, in request order. Safe to call from several threads at once."""
        if self._engine is None:
            raise EngineUnavailable("the vLLM engine is closed")
        if not requests:
            return []
        return self._loop.run(self._generate_all(list(requests)))

    async def _generate_all(self, requests: list[GenerationRequest]) -> list[Generation]:
        engine = self._engine
        tasks = [asyncio.create_task(self._generate_one(engine, request)) for request in requests]
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
                # vLLM does not wake every waiter when its engine process dies (a request added at that moment
                # waits forever), so look at the engine's health instead of trusting every request to end.
                if pending and engine.errored:
                    raise EngineUnavailable("the vLLM engine died while generating")
            return [task.result() for task in tasks]
        finally:
            # A failed request takes its siblings down: they are aborted in the engine. A dead engine may never
            # confirm an abort, so do not wait for that for long.
            unfinished = [task for task in tasks if not task.done()]
            for task in unfinished:
                task.cancel()
            if unfinished:
                await asyncio.wait(unfinished, timeout=ABORT_WAIT_S)

    async def _generate_one(self, engine, request: GenerationRequest) -> Generation:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        params = self._sampling_params(**sampling_kwargs(self.sampling, request), output_kind=self._final_only)
        request_id = f"{request.sample_id}-{next(self._request_ids)}"
        final = None
        try:
            prompt = _token_prompt(engine, request.prompt_ids)
            async for output in engine.generate(prompt, params, request_id):
                final = output
        except EngineDeadError as exc:
            raise EngineUnavailable(f"the vLLM engine died while generating sample {request.sample_id}") from exc
        except VLLMClientError as exc:
            raise GenerationRejected(f"sample {request.sample_id}: vLLM refused the request: {exc}") from exc
        if final is None or not final.finished:
            raise EngineUnavailable(f"sample {request.sample_id}: the vLLM engine returned no finished output")
        completion = final.outputs[0]
        if completion.finish_reason not in ("stop", "length"):
            raise EngineUnavailable(
                f"sample {request.sample_id}: generation ended with finish_reason={completion.finish_reason!r}"
            )
        return Generation(
            sample_id=request.sample_id,
            prompt_ids=list(final.prompt_token_ids),
            completion_ids=list(completion.token_ids),
            finish_reason=completion.finish_reason,
            text=completion.text,
        )

    def close(self) -> None:
        """Shut the engine down (its processes exit, or are killed after shutdown_timeout_s) and stop the loop."""
        engine, self._engine = self._engine, None
        if engine is None:
            return
        try:
            # Stop reading outputs first, so that the engine processes exiting is not reported as a failure.
            self._loop.run(self._stop_background(engine))
            engine.shutdown(timeout=self.settings.shutdown_timeout_s)
        finally:
            self._loop.stop(timeout=ABORT_WAIT_S)

    async def _stop_background(self, engine) -> None:
        tasks = [task for task in (self._stats_task, getattr(engine, "output_handler", None)) if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
