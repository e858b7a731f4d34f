"""Deployment configs for tests and benchmarks, written as real TOML files and loaded like any other."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import tomli_w


def to_toml(tables: dict[str, dict[str, Any]]) -> str:
    """TOML of `tables` keyed by dotted table names ("generate.sampling")."""
    nested: dict[str, Any] = {}
    for table, values in tables.items():
        node = nested
        for part in table.split("."):
            node = node.setdefault(part, {})
        node.update(values)
    return tomli_w.dumps(nested)


def tiny_config_tables(model_path: Path, storage: Path | str, broker_url: str, state_dir: Path) -> dict[str, dict[str, Any]]:
    """A CPU config for the tiny model: small shards, short completions, float32."""
    return {
        "run": {"name": "test", "state_dir": str(state_dir)},
        "broker": {"url": broker_url, "visibility_timeout_s": 600, "task_timeout_s": 300},
        "storage": {"url": str(storage)},
        "model": {"path": str(model_path), "name": "tiny-qwen3", "dtype": "float32", "device": "cpu"},
        "dataset": {"shard_size": 8, "thinking": "always"},
        "generate": {"engine": "transformers", "batch_size": 8},
        "generate.sampling": {"temperature": 0.8, "top_p": 0.95, "top_k": 50, "max_tokens": 48, "seed": 0},
        "extract": {"num_draft_layers": 3, "token_budget": 2048, "hidden_dtype": "bfloat16"},
        # The reference audit is a lane of its own, with workers of its own: tests of it turn it on.
        "audit": {"enabled": False},
    }


def write_config(path: Path, tables: dict[str, dict[str, Any]], **overrides: dict[str, Any]) -> Path:
    """Write `tables` with per-table overrides (`generate.sampling={"max_tokens": 8}` via a dict key)."""
    merged = {name: dict(values) for name, values in tables.items()}
    for table, values in overrides.items():
        merged.setdefault(table.replace("__", "."), {}).update(values)
    path.write_text(to_toml(merged))
    return path


def tiny_vllm_overrides(**settings: Any) -> dict[str, dict[str, Any]]:
    """Overrides that switch a tiny config to the vLLM engine on a CPU (vLLM's CPU build)."""
    return {
        "generate": {"engine": "vllm"},
        "generate.vllm": {
            "dtype": "float32",
            "max_model_len": 1024,
            "max_num_seqs": 32,
            "enforce_eager": True,
            "enable_chunked_prefill": False,  # required by vLLM's CPU build with seeded requests
            "kv_cache_memory_gib": 1.0,
            "inflight_tasks": 2,
            "log_stats_interval_s": 0,
            "shutdown_timeout_s": 30,
            **settings,
        },
    }


def local_copy(config_file: Path, root: Path, *, model: Path, tokenizer: Path, broker_url: str) -> Path:
    """A shipped config (worker_configs/) made to run here: the model and tokenizer given (a weightless example
    has config.json only, and no tokenizer), storage, staging and state under `root`, this broker."""
    import tomllib

    tables = tomllib.loads(config_file.read_text(encoding="utf-8"))
    tables["model"].update(path=str(model), tokenizer=str(tokenizer))
    tables["storage"]["url"] = str(root / "storage")
    tables["storage"].setdefault("uploader", {})["staging_dir"] = str(root / "staging")
    tables["run"]["state_dir"] = str(root / "state")
    tables["broker"]["url"] = broker_url
    path = root / config_file.name
    path.write_text(tomli_w.dumps(tables))
    return path
