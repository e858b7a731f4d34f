"""Storage key layout. Keys derive from shard ids only, so a re-delivered task writes the same keys."""

from __future__ import annotations

PROMPTS = "prompts"
COMPLETIONS = "completions"
SHARDS = "shards"


def prompts_key(shard_id: str) -> str:
    return f"{PROMPTS}/{shard_id}.jsonl"


def completions_key(shard_id: str) -> str:
    return f"{COMPLETIONS}/{shard_id}.jsonl"


def shard_key(shard_id: str) -> str:
    return f"{SHARDS}/{shard_id}.safetensors"


def shard_id_of(key: str) -> str:
    """The shard id of any key above."""
    name = key.rsplit("/", 1)[-1]
    return name.split(".", 1)[0]
