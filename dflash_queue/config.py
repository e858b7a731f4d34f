"""Deployment configuration: one TOML file, loaded into frozen, validated objects.

Every section forbids unknown keys and checks types strictly, so a typo fails at load with the file and the
dotted key in the message instead of silently falling back to a default hours into a run.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from dflash_queue.errors import ConfigError
from dflash_queue.storage.urls import check_storage_url

BROKER_URL_ENV = "DFQ_BROKER_URL"
STORAGE_URL_ENV = "DFQ_STORAGE_URL"

PositiveInt = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]


def _array_to_tuple(value: Any) -> Any:
    # TOML arrays load as lists; the frozen config keeps tuples.
    return tuple(value) if isinstance(value, list) else value


StrTuple = Annotated[tuple[str, ...], BeforeValidator(_array_to_tuple)]
LayerIds = Annotated[tuple[Annotated[int, Field(ge=0)], ...], BeforeValidator(_array_to_tuple)]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)


class RunConfig(_Section):
    # Namespaces every Redis key of this deployment, so two runs can share one Redis database.
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = "dfq"
    # Private broker data (AOF), staging files and logs of `dflash-queue run`.
    state_dir: str = ".dfq-state"


class BrokerConfig(_Section):
    # Empty: `dflash-queue run` starts a private redis-server; workers need a URL.
    url: str = ""
    # Redis has no lease a running task can extend: an unacked message older than this is handed to another
    # worker. It must exceed the longest task.
    visibility_timeout_s: PositiveInt = 4 * 3600
    task_timeout_s: PositiveInt = 2 * 3600
    # A task delivered more often than this (its worker died each time: OOM-kill, segfault, SIGKILL) goes to
    # the dead letters instead of taking down one more worker.
    max_deliveries: PositiveInt = 3
    # Retries of a task whose broker or storage connection failed (exponential backoff with jitter).
    transient_retries: PositiveInt = 8
    retry_backoff_max_s: PositiveFloat = 120.0

    @model_validator(mode="after")
    def _visibility_exceeds_longest_task(self) -> BrokerConfig:
        if self.visibility_timeout_s <= self.task_timeout_s:
            raise ValueError(
                f"visibility_timeout_s ({self.visibility_timeout_s}) must exceed task_timeout_s "
                f"({self.task_timeout_s}), or running tasks are re-delivered to other workers"
            )
        if self.url and not self.url.startswith(("redis://", "rediss://", "redis+socket://", "unix://")):
            raise ValueError(f"url must be a redis:// or rediss:// URL, got {self.url!r}")
        return self


class S3Config(_Section):
    """How to reach an S3-compatible store. Credentials never live here: they come from the AWS chain
    (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY/AWS_SESSION_TOKEN, a profile, an instance or pod role)."""

    # Empty: the AWS chain decides (AWS_ENDPOINT_URL_S3, AWS_ENDPOINT_URL, the profile; else AWS itself).
    endpoint_url: str = ""
    # Empty: AWS_REGION / AWS_DEFAULT_REGION / the profile.
    region: str = ""
    # A profile name in ~/.aws/config; empty: AWS_PROFILE or the default chain.
    profile: str = ""
    # MinIO and Ceph usually need "path"; "auto" lets botocore (and the profile) choose.
    addressing_style: Literal["auto", "path", "virtual"] = "auto"
    # The S3 checksum sent with every upload (checked by the store) and checked by botocore on whole-object
    # reads. "none" for stores that reject checksum headers. A sha256 of the content is stored in the object's
    # metadata and verified on every read whatever this says.
    checksum_algorithm: Literal["CRC32", "CRC32C", "SHA1", "SHA256", "none"] = "CRC32"
    # botocore retries throttling, 5xx and connection errors with backoff; "adaptive" also rate-limits the client.
    retry_mode: Literal["standard", "adaptive"] = "standard"
    max_attempts: Annotated[int, Field(ge=1, le=100)] = 10
    connect_timeout_s: PositiveFloat = 10.0
    read_timeout_s: PositiveFloat = 120.0
    # Objects at least this large are uploaded in parts of part_size_mb (S3's minimum part is 5 MiB).
    multipart_threshold_mb: Annotated[int, Field(ge=5, le=5120)] = 64
    part_size_mb: Annotated[int, Field(ge=5, le=5120)] = 64
    # Part uploads (and ranged downloads) in flight per worker process, over all shards.
    max_concurrency: Annotated[int, Field(ge=1, le=256)] = 10
    # At worker start-up, incomplete multipart uploads under the prefix older than this are aborted (left by
    # killed workers; S3 bills their parts). 0 disables. Keep it longer than any single upload takes.
    abort_stale_uploads_after_s: Annotated[int, Field(ge=0)] = 24 * 3600

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint_is_http(cls, value: str) -> str:
        if value and not value.startswith(("http://", "https://")):
            raise ValueError(f"must start with http:// or https://, got {value!r}")
        return value


class UploaderConfig(_Section):
    """The extract lane's background uploader: finished shards wait in a local staging directory."""

    # Empty: {run.state_dir}/staging. Use a local disk with room for max_pending shards.
    staging_dir: str = ""
    # Shards finished by the engine but not yet stored, per worker process. When reached, the next finished
    # shard waits (back-pressure) instead of filling the disk. The extract worker runs 1 + max_pending task
    # slots by default: one computing, the others waiting for their shard's upload.
    max_pending: Annotated[int, Field(ge=1, le=64)] = 2
    # Shards uploading at once (each in parallel parts, see storage.s3.max_concurrency).
    parallel_uploads: Annotated[int, Field(ge=1, le=64)] = 2

    @model_validator(mode="after")
    def _parallel_within_pending(self) -> UploaderConfig:
        if self.parallel_uploads > self.max_pending:
            raise ValueError(
                f"parallel_uploads ({self.parallel_uploads}) cannot exceed max_pending ({self.max_pending})"
            )
        return self


class StorageConfig(_Section):
    # A local directory (relative paths resolve against the config file), file:///path or s3://bucket/prefix.
    url: Annotated[str, Field(min_length=1)]
    # A task whose storage is unreachable (after botocore's own retries) is retried this many times, with
    # backoff up to two minutes, before its shard is marked failed.
    unavailable_task_retries: Annotated[int, Field(ge=0)] = 30
    s3: S3Config = S3Config()
    uploader: UploaderConfig = UploaderConfig()

    @field_validator("url")
    @classmethod
    def _url_is_usable(cls, value: str) -> str:
        return check_storage_url(value)


class ModelConfig(_Section):
    path: Annotated[str, Field(min_length=1)]
    tokenizer: str = ""
    # Recorded in every shard's metadata; defaults to the model directory's name.
    name: str = ""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "bfloat16"
    device: Literal["auto", "cpu", "cuda"] = "auto"

    @property
    def tokenizer_path(self) -> str:
        return self.tokenizer or self.path

    @property
    def display_name(self) -> str:
        return self.name or Path(self.path).name


class DatasetConfig(_Section):
    shard_size: PositiveInt = 256
    # "auto": rules on the content decide per sample (code, math, reasoning -> on; chit-chat, classification,
    # extraction -> off).
    thinking: Literal["always", "never", "auto"] = "always"
    # "last": regenerate the last assistant turn from the conversation before it (earlier ones stay as context);
    # "all": regenerate every assistant turn in order, each conditioned on the regenerated history.
    regenerate: Literal["last", "all"] = "last"
    # With regenerate = "all", the history each later turn is generated from. "as-served": the chat template's
    # rendering of the conversation so far, the regenerated replies as messages (what a serving stack sends;
    # reasoning stripped where the template strips it), one training sequence per turn where a reply is not in
    # the final prompt as generated. "as-generated": the exact ids generated so far plus the template's
    # continuation (earlier reasoning kept), one sequence.
    history: Literal["as-served", "as-generated"] = "as-served"
    # A record (JSONL line, array element, Parquet row) larger than this is reported and skipped.
    max_record_bytes: PositiveInt = 4 * 1024 * 1024
    # Skip prompts whose chat-templated token count leaves less than `generation_budget` tokens inside
    # `max_model_len`; counted with the target's own tokenizer at staging time.
    length_filter: bool = True
    # 0: the model's max_position_embeddings (config.json).
    max_model_len: Annotated[int, Field(ge=0)] = 0
    # 0: generate.sampling.max_tokens.
    generation_budget: Annotated[int, Field(ge=0)] = 0


class SamplingConfig(_Section):
    temperature: Annotated[float, Field(ge=0)] = 0.6
    top_p: Annotated[float, Field(gt=0, le=1)] = 0.95
    top_k: Annotated[int, Field(ge=-1)] = 20
    min_p: Annotated[float, Field(ge=0, le=1)] = 0.0
    max_tokens: PositiveInt = 4096
    repetition_penalty: PositiveFloat = 1.0
    stop: StrTuple = ()
    seed: int = 0


EnvName = Annotated[str, Field(pattern=r"^[A-Z_][A-Z0-9_]*$")]


class VllmConfig(_Section):
    """Settings of the vLLM engine (`generate.engine = "vllm"`): engine arguments and how it is fed."""

    tensor_parallel_size: PositiveInt = 1
    # Empty: model.dtype.
    dtype: Literal["", "auto", "float32", "bfloat16", "float16"] = ""
    # 0: the model's own context length.
    max_model_len: Annotated[int, Field(ge=0)] = 0
    gpu_memory_utilization: Annotated[float, Field(gt=0, le=1)] = 0.9
    max_num_seqs: PositiveInt = 256
    # 0: vLLM's default.
    max_num_batched_tokens: Annotated[int, Field(ge=0)] = 0
    enable_prefix_caching: bool = True
    # Must be false with vLLM's CPU build, which cannot replay a seeded request's sampler after a partial
    # prefill (the engine would stop with "CPU Generator does not use offset").
    enable_chunked_prefill: bool = True
    enforce_eager: bool = False
    # vLLM's engine seed. Every request also carries its own seed, derived from generate.sampling.seed and the
    # sample id, so a completion does not depend on which shards shared the engine with it.
    seed: int = 0
    # KV cache size; 0 lets vLLM size it (from gpu_memory_utilization, or VLLM_CPU_KVCACHE_SPACE on CPU).
    kv_cache_memory_gib: Annotated[float, Field(ge=0)] = 0.0
    # Tasks a worker runs at once against its one engine. More than one keeps the engine full while a
    # shard's slowest sequences finish: the other shards' waiting requests take the freed slots.
    inflight_tasks: PositiveInt = 3
    # Seconds between vLLM's throughput log lines; 0 turns them off.
    log_stats_interval_s: Annotated[float, Field(ge=0)] = 60.0
    # How long shutdown waits for vLLM's processes to exit before killing them.
    shutdown_timeout_s: PositiveFloat = 60.0
    # Environment for vLLM, set before it starts (e.g. VLLM_CPU_OMP_THREADS_BIND = "nobind" on CPU).
    env: dict[EnvName, str] = Field(default_factory=dict)


class GenerateConfig(_Section):
    engine: Literal["transformers", "vllm"] = "transformers"
    # Sequences per engine call for the Transformers engine.
    batch_size: PositiveInt = 8
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


class ExtractConfig(_Section):
    # K: the number of drafter layers the hidden states condition; picks the default layer ids.
    num_draft_layers: PositiveInt = 5
    # Explicit decoder-layer ids (output of layer i); when set they win over the DFlash default.
    layer_ids: LayerIds = ()
    # Tokens per forward pass (sequences are packed; a longer sequence runs alone). Halved on out-of-memory.
    token_budget: PositiveInt = 16384
    # fp8_e4m3: half the bytes of bfloat16, one fp32 scale per token and layer; readers dequantise.
    hidden_dtype: Literal["bfloat16", "float16", "float32", "fp8_e4m3"] = "bfloat16"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    # CUDA: captured layers go to pinned host memory asynchronously while the next pack computes (two packs'
    # states at a time, cached by torch's pinned allocator); off: plain synchronous copies.
    pin_memory: bool = True
    # How sequences share a forward pass. "auto": packed in one row where every token mixer of the model can be
    # confined to its sequence (attention with windows, soft-capping and sinks; Qwen3.5/Qwen3-Next linear
    # attention), else right-padded batches; chosen at load, confirmed by a probe and logged. "packed" refuses a
    # model that cannot be packed exactly; "padded" never packs.
    packing: Literal["auto", "packed", "padded"] = "auto"
    # Also store the last layer's output after the model's final norm (what EAGLE-3 trainers call the last
    # hidden state), as one more entry after the K layers, marked `final_norm` in the shard metadata.
    final_norm_state: bool = False
    # Samples per shard recomputed alone through the model's own attention and compared with their packed
    # states (chosen from the shard id, so a re-delivery checks the same ones). 0 turns the canary off.
    canary_samples: Annotated[int, Field(ge=0)] = 1
    # Relative error (per layer, over the sample) above which the canary fails the task for good; 0: by the
    # model's dtype (1e-4 for float32, 2e-2 for bfloat16, 5e-3 for float16).
    canary_tolerance: Annotated[float, Field(ge=0)] = 0.0
    # A sample whose median token RMS at a layer is more than this factor above or below the shard's median at
    # that layer fails the task (with all-zero and constant layers): states no forward pass gives.
    rms_outlier_factor: Annotated[float, Field(gt=1)] = 50.0
    # `plan` warns when a shard (dataset.shard_size samples of the expected length, in hidden_dtype) would be
    # larger than this: each shard is staged whole on the worker's disk and uploaded and read back as one object.
    max_shard_bytes: Annotated[int, Field(ge=1)] = 8 * 10**9

    @model_validator(mode="after")
    def _layer_ids_distinct(self) -> ExtractConfig:
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"layer_ids must be distinct, got {list(self.layer_ids)}")
        return self


class FlowerConfig(_Section):
    # Loopback by default: reach it through an SSH tunnel or a TLS proxy. Basic auth comes from the
    # FLOWER_BASIC_AUTH environment variable (user:password[,user2:password2]), never from this file.
    address: str = "127.0.0.1"
    port: Annotated[int, Field(ge=1, le=65535)] = 5555
    # Tasks kept in Flower's memory, oldest dropped first: a run makes two per shard.
    max_tasks: PositiveInt = 10000
    # Keep Flower's task history across its restarts in `db` (default: run.state_dir/flower.db).
    persistent: bool = False
    db: str = ""
    # Forget workers offline for this long (0: keep them listed).
    purge_offline_workers_s: Annotated[int, Field(ge=0)] = 0


GateAction = Literal["off", "flag", "drop", "retry"]


class QualityConfig(_Section):
    """The quality gate run on every generated turn before a shard is chained to extraction.

    Each check has an action: "off" (not checked), "flag" (kept, flagged in the completion record and the
    training shard metadata), "drop" (left out of the training shard, recorded in the completions shard with
    the decision), "retry" (generated once more with `retry_max_tokens`; if it fails again,
    `on_retry_failure` decides).
    """

    # Empty: no answer and no reasoning tokens at all.
    on_empty: GateAction = "drop"
    # Stub: a placeholder answer (the tokens after the thinking block closes): none at all, no letter or digit,
    # or stock filler only ("OK.", "Sure.", "N/A", "TODO", "..."). A short answer ("Paris.", a label) is no stub.
    on_stub: GateAction = "flag"
    # Short: fewer than `min_answer_tokens` answer tokens. Off by default: a short answer can be the right one.
    on_short: GateAction = "off"
    min_answer_tokens: Annotated[int, Field(ge=1)] = 8
    # Truncated: the engine stopped at the token budget (finish_reason "length").
    on_truncated: GateAction = "flag"
    # A thinking block that is opened and never closed: there is no answer.
    on_unclosed_thinking: GateAction = "retry"
    # A degenerate loop: the completion ends in `repetition_min_repeats` or more back-to-back copies of a unit
    # of at most `repetition_max_period` tokens, spanning at least `repetition_min_tokens` tokens.
    on_repetition: GateAction = "drop"
    repetition_max_period: PositiveInt = 256
    repetition_min_repeats: Annotated[int, Field(ge=2)] = 4
    repetition_min_tokens: PositiveInt = 32
    on_retry_failure: Literal["flag", "drop"] = "flag"
    # Token budget of a retry; 0: twice generate.sampling.max_tokens.
    retry_max_tokens: Annotated[int, Field(ge=0)] = 0


class Config(_Section):
    run: RunConfig = RunConfig()
    broker: BrokerConfig = BrokerConfig()
    storage: StorageConfig
    model: ModelConfig
    dataset: DatasetConfig = DatasetConfig()
    generate: GenerateConfig = GenerateConfig()
    extract: ExtractConfig = ExtractConfig()
    quality: QualityConfig = QualityConfig()
    flower: FlowerConfig = FlowerConfig()

    # Where the config came from; not a TOML key.
    source: str = Field(default="<memory>", exclude=True)

    @property
    def staging_dir(self) -> Path:
        """Where the extract lane stages finished shards before they are stored."""
        return Path(self.storage.uploader.staging_dir or Path(self.run.state_dir) / "staging")

    def fingerprint(self) -> str:
        """A short hash of everything that changes what a task writes (`output_settings`).

        Workers refuse messages whose fingerprint differs from their own, so a node started with another
        model or other sampling settings cannot mix its output into the run. Paths and URLs are left out:
        they differ between nodes of one run.
        """
        blob = json.dumps(self.output_settings(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def output_settings(self) -> dict[str, Any]:
        """Everything that changes what a task writes, by section: what the fingerprint hashes, and what a run
        compares to say how two configurations differ."""
        return {
            "model": {"name": self.model.display_name, "config": _model_config_digest(self.model.path)},
            "dataset": self.dataset.model_dump(mode="json", exclude={"max_record_bytes"}),
            "sampling": self.generate.sampling.model_dump(mode="json"),
            "quality": self.quality.model_dump(mode="json"),
            "extract": {
                "layer_ids": list(self.extract.layer_ids),
                "num_draft_layers": self.extract.num_draft_layers,
                "hidden_dtype": self.extract.hidden_dtype,
                "final_norm_state": self.extract.final_norm_state,
            },
        }

    @property
    def retry_max_tokens(self) -> int:
        return self.quality.retry_max_tokens or 2 * self.generate.sampling.max_tokens

    @property
    def generation_budget(self) -> int:
        return self.dataset.generation_budget or self.generate.sampling.max_tokens

    def max_model_len(self) -> int:
        """The context length prompts must fit in: dataset.max_model_len, else the model's own."""
        if self.dataset.max_model_len:
            return self.dataset.max_model_len
        return _model_max_positions(self.model.path)

    def with_overrides(self, **sections: dict[str, Any]) -> Config:
        """A copy with some keys replaced, validated like a loaded file."""
        data = self.model_dump(mode="python")
        for section, values in sections.items():
            data[section] = {**data[section], **values}
        return _validate(data, self.source, check_paths=False)


def _model_config_digest(model_path: str) -> str:
    config_file = Path(model_path) / "config.json"
    if not config_file.is_file():
        return "missing"
    return hashlib.sha256(config_file.read_bytes()).hexdigest()[:16]


def _model_max_positions(model_path: str) -> int:
    config_file = Path(model_path) / "config.json"
    try:
        data = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{config_file}: cannot read max_position_embeddings ({exc}); set dataset.max_model_len"
        ) from None
    text_config = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    value = text_config.get("max_position_embeddings") or data.get("max_position_embeddings")
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"{config_file}: no max_position_embeddings; set dataset.max_model_len")
    return value


def load_config(path: str | os.PathLike[str], *, env: dict[str, str] | None = None) -> Config:
    """Load and validate a deployment config; relative paths resolve against the file's directory."""
    path = Path(path)
    env = os.environ if env is None else env
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None

    if env.get(BROKER_URL_ENV):
        raw.setdefault("broker", {})["url"] = env[BROKER_URL_ENV]
    if env.get(STORAGE_URL_ENV):
        raw.setdefault("storage", {})["url"] = env[STORAGE_URL_ENV]
    _resolve_paths(raw, base=path.resolve().parent)
    return _validate(raw, str(path), check_paths=True)


def _resolve_paths(raw: dict[str, Any], base: Path) -> None:
    def resolve(section: str, key: str, *, url: bool = False) -> None:
        table = raw.get(section)
        if not isinstance(table, dict):
            return
        value = table.get(key)
        if not isinstance(value, str) or not value:
            return
        if url and "://" in value:
            return
        table[key] = str((base / Path(value).expanduser()).resolve())

    resolve("model", "path")
    resolve("model", "tokenizer")
    resolve("storage", "url", url=True)
    resolve("run", "state_dir")
    resolve("flower", "db")
    storage = raw.get("storage")
    uploader = storage.get("uploader") if isinstance(storage, dict) else None
    if isinstance(uploader, dict) and isinstance(uploader.get("staging_dir"), str) and uploader["staging_dir"]:
        uploader["staging_dir"] = str((base / Path(uploader["staging_dir"]).expanduser()).resolve())


# Keys that look like secrets. Credentials come from the AWS chain only, never from a file that is copied to
# every node and checked into repositories.
_CREDENTIAL_KEY = re.compile(r"access_key|secret|session_token|password|credential|api_key", re.IGNORECASE)


def _reject_credentials(raw: dict[str, Any], source: str) -> None:
    def walk(table: Any, path: str) -> None:
        if not isinstance(table, dict):
            return
        for key, value in table.items():
            dotted = f"{path}.{key}"
            if _CREDENTIAL_KEY.search(str(key)):
                raise ConfigError(
                    f"{source}: invalid configuration\n  {dotted}: credentials are never read from the config "
                    "file; use the AWS chain: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN) in "
                    "the environment, a profile (AWS_PROFILE or storage.s3.profile), or an instance/pod role"
                )
            walk(value, dotted)

    walk(raw.get("storage"), "storage")


def _validate(raw: dict[str, Any], source: str, *, check_paths: bool) -> Config:
    _reject_credentials(raw, source)
    try:
        config = Config.model_validate({**raw, "source": source})
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None
    _check_cross_section(config)
    if check_paths:
        _check_model_paths(config)
    return config


def _check_cross_section(config: Config) -> None:
    """Rules that tie keys of different sections together; named like per-key errors."""
    problems = []
    max_tokens = config.generate.sampling.max_tokens
    if config.quality.retry_max_tokens and config.quality.retry_max_tokens <= max_tokens:
        problems.append(
            f"  quality.retry_max_tokens: must exceed generate.sampling.max_tokens ({max_tokens}), "
            f"got {config.quality.retry_max_tokens}"
        )
    if config.dataset.max_model_len and config.generation_budget >= config.dataset.max_model_len:
        problems.append(
            f"  dataset.max_model_len: {config.dataset.max_model_len} leaves no room for a prompt next to the "
            f"generation budget of {config.generation_budget} tokens"
        )
    if problems:
        raise ConfigError("\n".join([f"{config.source}: invalid configuration", *problems]))


def _describe(exc: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for error in exc.errors():
        key = ".".join(str(part) for part in error["loc"]) or "<top level>"
        message = error["msg"]
        if error["type"] == "extra_forbidden":
            message = "unknown key"
        elif error["type"] == "missing":
            message = "required key is missing"
        elif "input" in error and error["type"] not in {"value_error", "assertion_error"}:
            message = f"{message} (got {error['input']!r})"
        lines.append(f"  {key}: {message}")
    return "\n".join(lines)


def _check_model_paths(config: Config) -> None:
    for key, value in (("model.path", config.model.path), ("model.tokenizer", config.model.tokenizer)):
        if value and not Path(value).exists():
            raise ConfigError(f"{config.source}: invalid configuration\n  {key}: no such path: {value}")
