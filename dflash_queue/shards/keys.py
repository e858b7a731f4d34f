"""Storage key layout. Keys derive from shard ids only, so a re-delivered task writes the same keys."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Listable(Protocol):
    def list(self, prefix: str) -> Iterable[str]: ...


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


def stored_shard_ids(storage: Listable) -> set[str]:
    """Ids of the training shards `storage` holds: what counts as done."""
    return {shard_id_of(key) for key in storage.list(SHARDS + "/")}
