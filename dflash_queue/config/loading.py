"""Deployment configuration: one TOML file, loaded into frozen, validated objects.

Every section forbids unknown keys and checks types strictly, so a typo fails at load with the file and the
dotted key in the message instead of silently falling back to a default hours into a run.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, ValidationError

from dflash_queue.config.sections import Section
from dflash_queue.data.config import DatasetConfig
from dflash_queue.engines.checkpoint_digest import weights_digest
from dflash_queue.engines.config import (
    ExtractVllmConfig,
    GenerateConfig,
    ModelConfig,
    SamplingConfig,
    VllmConfig,
)
from dflash_queue.engines.engine_args import NESTED_KEY_ERROR, output_args
from dflash_queue.errors import ConfigError
from dflash_queue.lanes.config import AuditConfig, ExtractConfig
from dflash_queue.ops.config import FlowerConfig
from dflash_queue.quality.config import QualityConfig
from dflash_queue.queue.config import PASSWORD_ENV, PASSWORD_FILE_ENV, BrokerConfig
from dflash_queue.storage.config import S3Config, StorageConfig, UploaderConfig

__all__ = [
    "BROKER_URL_ENV",
    "PASSWORD_ENV",
    "PASSWORD_FILE_ENV",
    "STORAGE_URL_ENV",
    "AuditConfig",
    "BrokerConfig",
    "Config",
    "DatasetConfig",
    "ExtractConfig",
    "ExtractVllmConfig",
    "FlowerConfig",
    "GenerateConfig",
    "ModelConfig",
    "QualityConfig",
    "RunConfig",
    "S3Config",
    "SamplingConfig",
    "StorageConfig",
    "UploaderConfig",
    "VllmConfig",
    "load_config",
]

BROKER_URL_ENV = "DFQ_BROKER_URL"
STORAGE_URL_ENV = "DFQ_STORAGE_URL"

class RunConfig(Section):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")] = "dfq"
    """Namespaces every Redis key of this deployment, so two runs can share one Redis database."""
    state_dir: str = ".dfq-state"
    """Private broker data (AOF), staging files and logs of `dflash-queue run`."""


class Config(Section):
    run: RunConfig = RunConfig()
    broker: BrokerConfig = BrokerConfig()
    storage: StorageConfig
    model: ModelConfig
    dataset: DatasetConfig = DatasetConfig()
    generate: GenerateConfig = GenerateConfig()
    extract: ExtractConfig = ExtractConfig()
    audit: AuditConfig = AuditConfig()
    quality: QualityConfig = QualityConfig()
    flower: FlowerConfig = FlowerConfig()

    source: str = Field(default="<memory>", exclude=True)
    """Where the config came from; not a TOML key."""

    @property
    def staging_dir(self) -> Path:
        """Where the extract lane stages finished shards before they are stored."""
        return Path(self.storage.uploader.staging_dir or Path(self.run.state_dir) / "staging")

    def fingerprint(self) -> str:
        """A short hash of everything that changes what a task writes (`output_settings`) but the weights' digest.

        Workers refuse messages whose fingerprint differs from their own, so a node started with another
        model or other sampling settings cannot mix its output into the run. Paths and URLs are left out:
        they differ between nodes of one run. So is `model.weights`: nodes without the weights take part in a run
        (a generate worker of inference servers, a producer with the model's config and tokenizer only), and a
        checkpoint's weights are compared where they are read, in the run's identity (runstate/run_identity.py).
        """
        blob = json.dumps(self._fingerprinted_settings(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:16]

    def output_settings(self) -> dict[str, Any]:
        """Everything that changes what a task writes, by section: what the fingerprint hashes, plus
        `model.weights` (a digest of the checkpoint's safetensors files, engines/checkpoint_digest.py) where
        model.path holds them; what a run records and compares to say how two configurations differ."""
        settings = self._fingerprinted_settings()
        weights = weights_digest(self.model.path)
        if weights is not None:
            settings["model"]["weights"] = weights
        return settings

    def _fingerprinted_settings(self) -> dict[str, Any]:
        return {
            "model": {"name": self.model.display_name, "config": _model_config_digest(self.model.path)},
            "dataset": self.dataset.model_dump(mode="json", exclude={"max_record_bytes", "staging_processes", "max_bad_share"}),
            "sampling": self.generate.sampling.model_dump(mode="json"),
            "quality": self.quality.model_dump(mode="json"),
            "extract": {
                "layer_ids": list(self.extract.layer_ids),
                "num_draft_layers": self.extract.num_draft_layers,
                "hidden_dtype": self.extract.hidden_dtype,
                "final_norm_state": self.extract.final_norm_state,
                "last_layer_state": self.extract.last_layer_state,
            },
            # Only present when set, so that configs without them keep the fingerprint they had.
            **{f"{lane}.vllm.engine_args": args for lane, args in self.engine_output_args().items()},
            # The model the inference servers must serve: a worker pointed at servers of another model (by its
            # config) refuses the run's tasks; start-up checks that the servers serve what the config says.
            **({"generate.server.model": self.served_model_name} if self.generate.engine == "server" else {}),
        }

    @property
    def served_model_name(self) -> str:
        """The model name the generate lane's inference servers serve: generate.server.model, else model.name,
        else the model directory's name."""
        return self.generate.server.model or self.model.display_name

    def engine_output_args(self) -> dict[str, dict[str, Any]]:
        """Per lane whose engine is vLLM, the engine_args that may change its outputs (speculative decoding,
        quantization, KV-cache dtype, ...: all but engine_args.OPERATIONAL); lanes with none left out."""
        found = {}
        if self.generate.engine == "vllm":
            found["generate"] = output_args(self.generate.vllm.engine_args)
        if self.extract.engine == "vllm":
            found["extract"] = output_args(self.extract.vllm.engine_args)
        return {lane: args for lane, args in found.items() if args}

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

    def extract_context_len(self) -> int:
        """The vLLM extract engine's max_model_len: extract.vllm.max_model_len, else the longest sequence staging
        admits plus the one token vLLM samples after it, within the model's own context."""
        if self.extract.vllm.max_model_len:
            return self.extract.vllm.max_model_len
        return min(self.max_model_len() + 1, _model_max_positions(self.model.path))

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


def load_config(
    path: str | os.PathLike[str], *, env: dict[str, str] | None = None, model: Mapping[str, str] | None = None
) -> Config:
    """Load and validate a deployment config; relative paths resolve against the file's directory. `model`
    replaces keys of its [model] table (paths as given on a command line: relative to the working directory)."""
    path = Path(path)
    environ: Mapping[str, str] = os.environ if env is None else env
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from None

    if environ.get(BROKER_URL_ENV):
        raw.setdefault("broker", {})["url"] = environ[BROKER_URL_ENV]
    if environ.get(STORAGE_URL_ENV):
        raw.setdefault("storage", {})["url"] = environ[STORAGE_URL_ENV]
    _resolve_paths(raw, base=path.resolve().parent)
    for key, value in (model or {}).items():
        raw.setdefault("model", {})[key] = str(Path(value).expanduser().resolve()) if key in ("path", "tokenizer") \
            else value
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
    resolve("broker", "password_file")
    generate = raw.get("generate")
    server = generate.get("server") if isinstance(generate, dict) else None
    if isinstance(server, dict) and isinstance(server.get("api_key_file"), str) and server["api_key_file"]:
        server["api_key_file"] = str((base / Path(server["api_key_file"]).expanduser()).resolve())
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
    generate = raw.get("generate")
    server = generate.get("server") if isinstance(generate, dict) else None
    for key in server if isinstance(server, dict) else ():
        if _CREDENTIAL_KEY.search(str(key)) and key not in ("api_key_file", "api_key_env"):
            raise ConfigError(
                f"{source}: invalid configuration\n  generate.server.{key}: the servers' API key is never read from "
                "the config file; name a file holding it in generate.server.api_key_file, or an environment "
                "variable in generate.server.api_key_env"
            )
    broker = raw.get("broker")
    for key in broker if isinstance(broker, dict) else ():
        if _CREDENTIAL_KEY.search(str(key)) and key != "password_file":
            raise ConfigError(
                f"{source}: invalid configuration\n  broker.{key}: the broker's password is never read from the "
                f"config file; set {PASSWORD_ENV}, or name a file holding it in {PASSWORD_FILE_ENV} or "
                "broker.password_file"
            )


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
        loc = list(error["loc"])
        if error["type"] == NESTED_KEY_ERROR:  # a key inside a table (engine_args): named as a dotted key too
            loc.append(error["ctx"]["key"])
        key = ".".join(str(part) for part in loc) or "<top level>"
        message = error["msg"]
        if error["type"] == NESTED_KEY_ERROR:
            pass
        elif error["type"] == "extra_forbidden":
            message = "unknown key" + _nearest_key(loc)
        elif error["type"] == "missing":
            message = "required key is missing"
        elif "input" in error and error["type"] not in {"value_error", "assertion_error"}:
            message = f"{message} (got {error['input']!r})"
        lines.append(f"  {key}: {message}")
    return "\n".join(lines)


def _nearest_key(loc: list[Any]) -> str:
    """"; did you mean X?" for an unknown key `loc` (a path into the config), X the closest key its table has."""
    model: Any = Config
    for part in loc[:-1]:
        field = model.model_fields.get(str(part)) if isinstance(model, type) and issubclass(model, Section) else None
        if field is None:
            return ""
        model = field.annotation
    if not (isinstance(model, type) and issubclass(model, Section)):
        return ""
    known = [name for name, field in model.model_fields.items() if not field.exclude]
    close = difflib.get_close_matches(str(loc[-1]), known, n=1, cutoff=0.6)
    return f"; did you mean {close[0]}?" if close else ""


def _check_model_paths(config: Config) -> None:
    for key, value in (("model.path", config.model.path), ("model.tokenizer", config.model.tokenizer)):
        if value and not Path(value).exists():
            raise ConfigError(f"{config.source}: invalid configuration\n  {key}: no such path: {value}")
