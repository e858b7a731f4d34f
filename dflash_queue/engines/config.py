"""The engines' settings: the `[generate]` section, and the extract engines' keys of the `[extract]` section."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from dflash_queue.config.sections import LayerIds, PositiveFloat, PositiveInt, Section, StrTuple
from dflash_queue.engines.engine_args import EXTRACT_REFUSED, GENERATE_REFUSED, check_engine_args, speculative_method
from dflash_queue.errors import ConfigError


class ModelConfig(Section):
    path: Annotated[str, Field(min_length=1)]
    """Target model directory (must exist; relative paths resolve against the config file)."""
    tokenizer: str = ""
    """Tokenizer directory; empty: model.path."""
    name: str = ""
    """Recorded in every shard's metadata; defaults to the model directory's name."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "bfloat16"
    """Weights dtype of the extract and Transformers generate engines."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """"auto": CUDA when available, else CPU."""

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path

    @property
    def display_name(self) -> str:
        return self.name or Path(self.path).name


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


class VllmEngineSettings(Section):
    """Engine arguments the vLLM engines of both lanes take, with the same meaning."""

    tensor_parallel_size: PositiveInt = 1
    """GPUs one engine spans: the worker's GPU group (`worker --gpus 0-3`, the systemd install's groups). On vLLM's
    CPU build, its ranks' cores (VLLM_CPU_OMP_THREADS_BIND, set by the worker unless given)."""
    dtype: Literal["", "auto", "float32", "bfloat16", "float16"] = ""
    """Empty: model.dtype."""
    max_model_len: Annotated[int, Field(ge=0)] = 0
    """0: the model's own context length."""
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    """Share of GPU memory vLLM may take for weights, activations and KV cache."""
    max_num_seqs: PositiveInt = 256
    """Sequences the engine runs at once."""
    max_num_batched_tokens: Annotated[int, Field(ge=0)] = 0
    """Tokens per engine step; 0: vLLM's default (the extract engine's: extract.token_budget)."""
    enforce_eager: bool = False
    """Run without CUDA graphs (slower; for debugging)."""
    kv_cache_memory_gib: Annotated[float, Field(ge=0)] = 0.0
    """KV cache size per rank; 0 lets vLLM size it from gpu_memory_utilization on a GPU. On vLLM's CPU build, 0 (and
    no VLLM_CPU_KVCACHE_SPACE) sizes it for the sequences the lane keeps in flight at max_model_len, within a quarter
    of the memory free at start."""
    log_stats_interval_s: Annotated[float, Field(ge=0)] = 60.0
    """Seconds between vLLM's throughput log lines; 0 turns them off."""
    shutdown_timeout_s: PositiveFloat = 60.0
    """How long shutdown waits for vLLM's processes to exit before killing them."""
    env: dict[EnvName, str] = Field(default_factory=dict)
    """Environment for vLLM, set before it starts (e.g. VLLM_CPU_OMP_THREADS_BIND = "nobind" on CPU)."""
    engine_args: dict[str, Any] = Field(default_factory=dict)
    """Any other of vLLM's engine arguments (`AsyncEngineArgs` fields), checked against the installed vLLM when the
    config loads: e.g. speculative_config = { method = "mtp", num_speculative_tokens = 2 }, quantization = "fp8",
    kv_cache_dtype = "fp8". Keys this section or the project sets are refused, saying where they are set. Every key
    but a few that only change speed, memory or logging (engine_args.OPERATIONAL) enters the run's fingerprint and
    the training shards' metadata; docs/vllm.md says what each changes."""

    # engine_args keys the project sets itself in this lane, and why.
    refused_engine_args: ClassVar[dict[str, str]] = {}

    @field_validator("engine_args")
    @classmethod
    def _known_engine_args(cls, value: dict[str, Any]) -> dict[str, Any]:
        check_engine_args(value, cls.refused_engine_args)
        return value


class VllmConfig(VllmEngineSettings):
    """Settings of the generate lane's vLLM engine (`generate.engine = "vllm"`): engine arguments and how it is
    fed."""

    enable_prefix_caching: bool = True
    """Reuse the KV cache of shared prompt prefixes (system prompts, earlier turns)."""
    enable_chunked_prefill: bool = True
    """Must be false with vLLM's CPU build, which cannot replay a seeded request's sampler after a partial prefill
    (the engine would stop with "CPU Generator does not use offset")."""
    seed: int = 0
    """vLLM's engine seed. Every request also carries its own seed, derived from generate.sampling.seed and the
    sample id, so a completion does not depend on which shards shared the engine with it."""
    inflight_tasks: PositiveInt = 3
    """Tasks a worker runs at once against its one engine. More than one keeps the engine full while a shard's
    slowest sequences finish: the other shards' waiting requests take the freed slots."""

    refused_engine_args: ClassVar[dict[str, str]] = GENERATE_REFUSED


# KV-cache dtypes that quantize the cache: the target's attention then reads quantized keys and values, and every
# state after the first attention layer differs from the model's own.
QUANTIZED_KV_CACHE = ("fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc")


class ExtractVllmConfig(VllmEngineSettings):
    """Settings of the extract lane's vLLM engine (`extract.engine = "vllm"`). vLLM's `extract_hidden_states`
    method caches the residual stream before the extracted layers; the worker's own KV connector hands each
    sequence's states over through shared memory. Prefix caching is always off in this lane: with it vLLM returns
    states shorter than the tokens (vLLM #44485)."""

    enable_chunked_prefill: bool = True
    """Long sequences prefilled over several engine steps. Safe here: the cache blocks that hold each sequence's
    states are zeroed when allocated and every sequence is checked whole (no token left unwritten) before it is
    stored."""
    max_model_len: Annotated[int, Field(ge=0)] = 0
    """The engine's context. vLLM refuses a sequence that leaves no room for the one token it samples after it, so
    0 means the longest sequence staging admits (dataset.max_model_len, else the model's context) plus one, within
    the model's own context (where a sequence filling the model's whole context is dead-lettered with vLLM's
    reason). A smaller value refuses longer sequences the same way."""
    inflight_tasks: PositiveInt = 2
    """Tasks a worker runs at once against its one engine, so that the engine stays full while a shard's last
    sequences finish and its shard is written."""
    pipeline_parallel_size: PositiveInt = 1
    """Must be 1: under pipeline parallelism vLLM returns the wrong layers' states (vLLM #36151). A target larger
    than one GPU runs with tensor_parallel_size instead; more GPUs in data parallel are more workers."""
    kv_cache_dtype: Literal["auto", "bfloat16", "float16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc"] = "auto"
    """The target's KV cache dtype. Quantized (fp8) caches are refused: the attention would read quantized keys and
    values, and every state after the first attention layer would differ from the model's own."""
    reference_check: bool = True
    """When the engine loads (and in `doctor`), its states of a probe batch (several sequences of different
    lengths, run together as production runs them) are compared at every captured entry, the last-layer and
    final-norm ones included, with the checkpoint's own Transformers forward, streamed one decoder layer at a time
    from the safetensors files (the memory of one layer) on a spare GPU of the worker's, else on host cores, in
    float32 and in the engine's dtype; beyond what the dtype's rounding explains, per token and per sequence, the
    engine refuses to start. It sees what the canary cannot, an error the same batched and alone: a layer or token
    off by one, rows read from the wrong cache slots, the last state taken after the final norm, a kernel computing
    something else. Turning it off leaves only the run-time audit ([audit]) to see those; `doctor` warns."""
    reference_tokens: Annotated[int, Field(ge=0)] = 0
    """Tokens of that probe batch. 0: a prefill step and a half of the engine (max_num_batched_tokens), so that
    sequences are cut across steps, where the reference runs on a spare GPU or the engine on the CPU build; 1,024
    where it runs on host cores beside a GPU engine (a 27B target's reference then takes minutes: docs/extraction.md;
    the audit covers long sequences)."""
    transfer_dir: str = ""
    """Where the engine's processes hand each sequence's states to the worker: a tmpfs (memory) directory. Empty:
    /dev/shm. Each engine uses a sub-directory of its own, removed when it stops (and by the next worker on this
    host when its process died); it holds the states of the sequences finished but not yet written to the
    shard, a few sequences at a time."""

    refused_engine_args: ClassVar[dict[str, str]] = EXTRACT_REFUSED

    @model_validator(mode="before")
    @classmethod
    def _replaced_keys(cls, values: Any) -> Any:
        if isinstance(values, dict) and "reference_layers" in values:
            raise ValueError(
                "reference_layers was replaced: the load-time comparison now covers every captured entry with the "
                "checkpoint's forward streamed one layer at a time; set reference_check (true/false) and, if "
                "needed, reference_tokens instead"
            )
        return values

    @field_validator("pipeline_parallel_size")
    @classmethod
    def _no_pipeline_parallelism(cls, value: int) -> int:
        if value != 1:
            raise ValueError(
                f"{value}: under pipeline parallelism vLLM returns the wrong layers' hidden states (vLLM #36151); "
                "use tensor_parallel_size"
            )
        return value

    @field_validator("kv_cache_dtype")
    @classmethod
    def _unquantized_kv_cache(cls, value: str) -> str:
        if value in QUANTIZED_KV_CACHE:
            raise ValueError(
                f"{value!r}: a quantized KV cache changes every hidden state after the first attention layer; "
                "extraction needs the model's own attention ('auto')"
            )
        return value


ServerKind = Literal["vllm", "sglang", "openai"]
# Sampling keys outside the OpenAI completions API, with the value that leaves sampling as it is: a server of
# unknown make (kind "openai") may ignore them silently.
NON_OPENAI_SAMPLING = {"top_k": (-1, 0), "min_p": (0.0,), "repetition_penalty": (1.0,)}


def _check_server_url(url: str) -> str:
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"{url!r}: a server's base URL is http://host:port or https://host[:port][/path]")
    if parts.username is not None or parts.password is not None:
        raise ValueError(
            "a server URL holds credentials: they would be copied with the config file and shown wherever the URL "
            "is; put the API key in a file (generate.server.api_key_file) or an environment variable "
            "(generate.server.api_key_env)"
        )
    if parts.query or parts.fragment:
        raise ValueError(f"{url!r}: a server's base URL takes no query or fragment")
    return url.rstrip("/")


class ServerConfig(Section):
    """Settings of the generate lane's inference-server engine (`generate.engine = "server"`): the worker loads no
    model; it sends each prompt's token ids to running inference servers (vLLM's or SGLang's) and keeps the token
    ids they return. docs/serving-fleet.md says how to point a job at a fleet."""

    urls: StrTuple = ()
    """Base URLs of the servers (e.g. "http://10.0.0.5:8000"; vLLM's and OpenAI-compatible servers without the
    /v1). A worker spreads its requests over every server that is up: each new request goes to the one with the
    fewest of this worker's requests outstanding."""
    kind: ServerKind = "vllm"
    """"vllm" (vLLM's OpenAI-compatible server: /v1/completions with token-id prompts and return_token_ids),
    "sglang" (SGLang's native /generate with input_ids, output_ids) or "openai" (any server answering
    /v1/completions in vLLM's shape with token ids; only the OpenAI API's sampling keys are sent)."""
    model: str = ""
    """The model name the servers serve (vLLM's --served-model-name, SGLang's model path); empty: model.name, else
    the model directory's name. Checked on every server at start and enters the run's fingerprint."""
    api_key_file: str = ""
    """File holding the servers' API key (its first line), sent as `Authorization: Bearer`. Never put the key in
    the config; relative paths resolve against the config file. Empty (and api_key_env empty): no key."""
    api_key_env: Annotated[str, Field(pattern=r"^([A-Z_][A-Z0-9_]*)?$")] = ""
    """Name of the environment variable holding the servers' API key (e.g. "DFQ_SERVER_API_KEY")."""
    requests_in_flight: PositiveInt = 256
    """Requests a worker keeps at its servers at once, all servers together. Size it to the servers' batch: at
    least their max_num_seqs summed, or the servers run part-empty."""
    inflight_tasks: PositiveInt = 4
    """Tasks (shards) a worker runs at once. More than one keeps the servers full while a shard's slowest replies
    finish: the other shards' requests take the freed places."""
    connect_timeout_s: PositiveFloat = 10.0
    """How long connecting to a server may take before it counts as down."""
    request_timeout_s: PositiveFloat = 3600.0
    """How long one request (a whole reply, the longest thinking included) may take."""
    max_tries: PositiveInt = 4
    """Tries of a request that fails on a server that still answers its health check (a 5xx, a timeout, a reply
    without token ids); after that many the sample alone is dead-lettered with the server's words. Requests that
    fail because a server is down are not counted: they go to the other servers, or wait for one to come back."""
    backoff_initial_s: PositiveFloat = 1.0
    """First wait before a failed request is tried again and before a down server is probed again; doubled after
    each failure, up to backoff_max_s."""
    backoff_max_s: PositiveFloat = 30.0
    """Longest wait between probes of a down server (and between tries of a request)."""
    recheck_interval_s: Annotated[float, Field(ge=0)] = 300.0
    """How often each server in use is checked again as at start (the model it serves, its context, its tokenizer,
    its weights' fingerprint): a server restarted behind the same URL or a balancer with other weights is refused
    within this long. A server is also checked again after any broken connection and after it was down. 0: no
    periodic checks."""
    fingerprint_tolerance: PositiveFloat = 0.1
    """How far (in nats) a server's logprobs for the weights probe (a fixed greedy request: its token ids and their
    logprobs) may lie from those the run recorded first and still count as the same weights: room for batch and
    kernel noise between identical servers (bfloat16), not for another checkpoint. A server beyond it is refused,
    naming the token where it differs; `doctor` shows how far each server lies from the first."""
    breaker_failures: PositiveInt = 5
    """Failed requests in a row (a 5xx, a timeout, a reply without token ids) on a server whose health check passes
    that open its breaker: the server counts as down for a backoff (backoff_initial_s, doubling while it keeps
    failing), its requests go to the other servers or wait, and the failures that opened it are not counted
    against max_tries. Then a check and one trial request close it again."""

    @field_validator("urls")
    @classmethod
    def _base_urls(cls, urls: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(_check_server_url(url) for url in urls)

    @model_validator(mode="after")
    def _one_key_source(self) -> ServerConfig:
        if self.api_key_file and self.api_key_env:
            raise ValueError("set api_key_file or api_key_env, not both")
        if len(set(self.urls)) != len(self.urls):
            raise ValueError(f"urls must be distinct, got {list(self.urls)}")
        if self.backoff_max_s < self.backoff_initial_s:
            raise ValueError(
                f"backoff_max_s ({self.backoff_max_s}) must be at least backoff_initial_s ({self.backoff_initial_s})"
            )
        return self

    def api_key(self, env: Mapping[str, str] | None = None) -> str | None:
        """The API key, read now from api_key_file or api_key_env; None when neither is set. ConfigError naming
        the key when the file or variable is missing or empty. The key is never logged or shown."""
        environ = os.environ if env is None else env
        if self.api_key_env:
            key = environ.get(self.api_key_env, "")
            if not key:
                raise ConfigError(
                    f"generate.server.api_key_env: the environment variable {self.api_key_env} is not set or empty"
                )
            return key
        if self.api_key_file:
            try:
                lines = Path(self.api_key_file).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
                raise ConfigError(
                    f"generate.server.api_key_file: cannot read {self.api_key_file}: {reason}"
                ) from None
            if not lines or not lines[0].strip():
                raise ConfigError(f"generate.server.api_key_file: {self.api_key_file} is empty")
            return lines[0].strip()
        return None


class GenerateConfig(Section):
    engine: Literal["transformers", "vllm", "server"] = "transformers"
    """"transformers" (batched `generate`), "vllm" (one resident vLLM engine per worker; see generate.vllm) or
    "server" (no model in the worker: running inference servers generate; see generate.server)."""
    batch_size: PositiveInt = 8
    """Sequences per engine call for the Transformers engine."""
    sampling: SamplingConfig = SamplingConfig()
    vllm: VllmConfig = VllmConfig()
    server: ServerConfig = ServerConfig()

    @model_validator(mode="after")
    def _servers_named(self) -> GenerateConfig:
        if self.engine != "server":
            return self
        if not self.server.urls:
            raise ValueError('generate.server.urls is empty: engine = "server" needs the servers\' base URLs')
        if self.server.kind == "openai":
            for key, neutral in NON_OPENAI_SAMPLING.items():
                value = getattr(self.sampling, key)
                if value not in neutral:
                    raise ValueError(
                        f"generate.sampling.{key} = {value} is not part of the OpenAI completions API, so a server of "
                        f'kind "openai" may ignore it; set generate.server.kind to "vllm" or "sglang" if the servers '
                        f"are, or set it to {neutral[0]}"
                    )
        return self

    @model_validator(mode="after")
    def _budget_fits_context(self) -> GenerateConfig:
        limit = self.vllm.max_model_len
        if self.engine == "vllm" and limit and self.sampling.max_tokens >= limit:
            raise ValueError(
                f"generate.sampling.max_tokens ({self.sampling.max_tokens}) must be below "
                f"generate.vllm.max_model_len ({limit}), which also holds the prompt"
            )
        method = speculative_method(self.vllm.engine_args)
        if self.engine == "vllm" and method and self.sampling.min_p:
            raise ValueError(
                f"generate.sampling.min_p ({self.sampling.min_p}) is ignored by vLLM under speculative decoding "
                f"(generate.vllm.engine_args.speculative_config, method {method!r}): set it to 0 or drop the "
                "speculative_config"
            )
        return self


class ExtractEngineSettings(Section):
    """The extract engines' keys of the `[extract]` section (the lane's own keys: `lanes/config.py`)."""

    engine: Literal["transformers", "vllm"] = "transformers"
    """"transformers" (the checkpoint's own decoder, packed passes, on one GPU or spread over the worker's GPU
    group) or "vllm" (one resident vLLM engine per worker, tensor parallel over its GPU group; see extract.vllm).
    Both store the same states, layers and metadata; docs/extraction.md says when to choose which."""
    num_draft_layers: PositiveInt = 5
    """K: the number of drafter layers the hidden states condition; picks the default layer ids."""
    layer_ids: LayerIds = ()
    """Explicit decoder-layer ids (output of layer i); when set they win over the DFlash default."""
    token_budget: PositiveInt = 16384
    """Transformers engine: tokens per forward pass (sequences are packed; a longer sequence runs alone). Halved on
    out-of-memory. The vLLM engine's tokens per step (max_num_batched_tokens) unless extract.vllm sets them."""
    hidden_dtype: Literal["bfloat16", "float16", "float32", "fp8_e4m3"] = "bfloat16"
    """fp8_e4m3: half the bytes of bfloat16, one fp32 scale per token and layer; readers dequantise."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Transformers engine: the attention kernels of the model the extract lane runs."""
    pin_memory: bool = True
    """Transformers engine on CUDA: captured layers go to pinned host memory asynchronously while the next pack computes (two packs'
    states at a time, cached by torch's pinned allocator); off: plain synchronous copies."""
    packing: Literal["auto", "packed", "padded"] = "auto"
    """Transformers engine: how sequences share a forward pass. "auto": packed in one row where every token mixer of the model can be
    confined to its sequence (attention with windows, soft-capping and sinks; Qwen3.5/Qwen3-Next linear
    attention), else right-padded batches; chosen at load, confirmed by a probe and logged. "packed" refuses a
    model that cannot be packed exactly; "padded" never packs."""
    last_layer_state: bool = False
    """Also store the last decoder layer's output before the final norm, as an entry of its own after the K layers,
    marked `last_layer` in the shard metadata: the verifier's last hidden state as vLLM (aux layer N) and
    speculators' EAGLE-3 and DFlash trainers take it (they apply the verifier's norm themselves).
    `export --format speculators` needs it."""
    final_norm_state: bool = False
    """Also store the last layer's output after the model's final norm (Transformers' last hidden_states entry: the
    target hidden state SpecForge's EAGLE-3 trainer reads), as one more entry after the K layers (and after the
    `last_layer` entry), marked `final_norm` in the shard metadata. `export --format specforge --method eagle3`
    needs it."""
    vllm: ExtractVllmConfig = ExtractVllmConfig()

    def captured_entries(self, num_layers: int) -> list[tuple[int, str]]:
        """What each stored entry is, in order, for a model of `num_layers` layers: (decoder layer id, kind)."""
        from dflash_queue.engines.layers import captured_entries, resolve_layer_ids

        layer_ids = resolve_layer_ids(self.layer_ids, num_layers, self.num_draft_layers)
        return captured_entries(
            layer_ids, num_layers, last_layer_state=self.last_layer_state, final_norm_state=self.final_norm_state
        )

    @model_validator(mode="after")
    def _layer_ids_distinct(self) -> ExtractEngineSettings:
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"layer_ids must be distinct, got {list(self.layer_ids)}")
        return self
