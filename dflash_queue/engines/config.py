"""The `[generate]` and `[extract]` sections: the engines of the two lanes and how they are fed."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from dflash_queue.settings import LayerIds, PositiveFloat, PositiveInt, Section, StrTuple


class SamplingConfig(Section):
    temperature: Annotated[float, Field(ge=0)] = 0.6
    """Sampling temperature; 0 is greedy."""
    top_p: Annotated[float, Field(gt=0, le=1)] = 0.95
    """Nucleus sampling: the smallest set of tokens whose probability reaches top_p."""
    top_k: Annotated[int, Field(ge=-1)] = 20
    """Sample among the k most likely tokens; -1 (or 0) turns it off."""
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    """Drop tokens less likely than min_p times the most likely one."""
    max_tokens: PositiveInt = 4096
    """Token budget of one generated turn (reasoning included)."""
    repetition_penalty: PositiveFloat = 1.0
    """1.0 leaves logits as they are; above 1 penalises tokens already present."""
    stop: StrTuple = ()
    """Strings that end a turn (the tokenizer's end-of-turn tokens always do)."""
    seed: int = 0
    """Base of every request's seed (with the sample id), so a completion does not depend on its batch."""


EnvName = Annotated[str, Field(pattern=r"^[A-Z_][A-Z0-9_]*$")]


class VllmConfig(Section):
    """Settings of the vLLM engine (`generate.engine = "vllm"`): engine arguments and how it is fed."""

    tensor_parallel_size: PositiveInt = 1
    """GPUs one engine spans (the worker's GPU group)."""
    dtype: Literal["", "auto", "float32", "bfloat16", "float16"] = ""
    """Empty: model.dtype."""
    max_model_len: Annotated[int, Field(ge=0)] = 0
    """0: the model's own context length."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    """Share of GPU memory vLLM may take for weights, activations and KV cache."""
    max_num_seqs: PositiveInt = 256
    """Sequences the engine decodes at once."""
    max_num_batched_tokens: Annotated[int, Field(ge=0)] = 0
    """0: vLLM's default."""
    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (system prompts, earlier turns)."""
    enable_chunked_prefill: bool = True
    """Must be false with vLLM's CPU build, which cannot replay a seeded request's sampler after a partial prefill
    (the engine would stop with "CPU Generator does not use offset")."""
    enforce_eager: bool = False
    """Run without CUDA graphs (slower; for debugging)."""
    seed: int = 0
    """vLLM's engine seed. Every request also carries its own seed, derived from generate.sampling.seed and the
    sample id, so a completion does not depend on which shards shared the engine with it."""
    kv_cache_memory_gib: Annotated[float, Field(ge=0)] = 0.0
    """KV cache size; 0 lets vLLM size it (from gpu_memory_utilization, or VLLM_CPU_KVCACHE_SPACE on CPU)."""
    inflight_tasks: PositiveInt = 3
    """Tasks a worker runs at once against its one engine. More than one keeps the engine full while a shard's
    slowest sequences finish: the other shards' waiting requests take the freed slots."""
    log_stats_interval_s: Annotated[float, Field(ge=0)] = 60.0
    """Seconds between vLLM's throughput log lines; 0 turns them off."""
    shutdown_timeout_s: PositiveFloat = 60.0
    """How long shutdown waits for vLLM's processes to exit before killing them."""
    env: dict[EnvName, str] = Field(default_factory=dict)
    """Environment for vLLM, set before it starts (e.g. VLLM_CPU_OMP_THREADS_BIND = "nobind" on CPU)."""


class GenerateConfig(Section):
    engine: Literal["transformers", "vllm"] = "transformers"
    """"transformers" (batched `generate`) or "vllm" (one resident vLLM engine per worker; see generate.vllm)."""
    batch_size: PositiveInt = 8
    """Sequences per engine call for the Transformers engine."""
    sampling: SamplingConfig = SamplingConfig()
    vllm: VllmConfig = VllmConfig()

    @model_validator(mode="after")
    def _budget_fits_context(self) -> GenerateConfig:
        limit = self.vllm.max_model_len
        if self.engine == "vllm" and limit and self.sampling.max_tokens >= limit:
            raise ValueError(
                f"generate.sampling.max_tokens ({self.sampling.max_tokens}) must be below "
                f"generate.vllm.max_model_len ({limit}), which also holds the prompt"
            )
        return self


class ExtractConfig(Section):
    num_draft_layers: PositiveInt = 5
    """K: the number of drafter layers the hidden states condition; picks the default layer ids."""
    layer_ids: LayerIds = ()
    """Explicit decoder-layer ids (output of layer i); when set they win over the DFlash default."""
    token_budget: PositiveInt = 16384
    """Tokens per forward pass (sequences are packed; a longer sequence runs alone). Halved on out-of-memory."""
    hidden_dtype: Literal["bfloat16", "float16", "float32", "fp8_e4m3"] = "bfloat16"
    """fp8_e4m3: half the bytes of bfloat16, one fp32 scale per token and layer; readers dequantise."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernels of the Transformers model the extract lane runs."""
    pin_memory: bool = True
    """CUDA: captured layers go to pinned host memory asynchronously while the next pack computes (two packs'
    states at a time, cached by torch's pinned allocator); off: plain synchronous copies."""
    packing: Literal["auto", "packed", "padded"] = "auto"
    """How sequences share a forward pass. "auto": packed in one row where every token mixer of the model can be
    confined to its sequence (attention with windows, soft-capping and sinks; Qwen3.5/Qwen3-Next linear
    attention), else right-padded batches; chosen at load, confirmed by a probe and logged. "packed" refuses a
    model that cannot be packed exactly; "padded" never packs."""
    final_norm_state: bool = False
    """Also store the last layer's output after the model's final norm (what EAGLE-3 trainers call the last hidden
    state), as one more entry after the K layers, marked `final_norm` in the shard metadata."""
    canary_samples: Annotated[int, Field(ge=0)] = 1
    """Samples per shard recomputed alone through the model's own attention and compared with their packed states
    (chosen from the shard id, so a re-delivery checks the same ones). 0 turns the canary off."""
    canary_tolerance: Annotated[float, Field(ge=0)] = 0.0
    """Relative error (per layer, over the sample) above which the canary fails the task for good; 0: by the
    model's dtype (1e-4 for float32, 2e-2 for bfloat16, 5e-3 for float16)."""
    rms_outlier_factor: Annotated[float, Field(gt=1)] = 50.0
    """A sample whose median token RMS at a layer is more than this factor above or below the shard's median at
    that layer fails the task (with all-zero and constant layers): states no forward pass gives."""
    max_shard_bytes: Annotated[int, Field(ge=1)] = 8 * 10**9
    """`plan` warns when a shard (dataset.shard_size samples of the expected length, in hidden_dtype) would be
    larger than this: each shard is staged whole on the worker's disk and uploaded and read back as one object."""

    @model_validator(mode="after")
    def _layer_ids_distinct(self) -> ExtractConfig:
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"layer_ids must be distinct, got {list(self.layer_ids)}")
        return self
