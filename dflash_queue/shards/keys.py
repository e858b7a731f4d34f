"""Storage key layout. Keys derive from shard ids only, so a re-delivered task writes the same keys."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class Listable(Protocol):
    def list(self, prefix: str) -> Iterable[str]: ...


PROMPTS = "prompts"
COMPLETIONS = "completions"
SHARDS = "shards"
# Training shards of epochs after the first (re-extracted from stored completions), one folder per epoch.
EPOCHS = "epochs"
# A record per training shard every consumer acknowledged and retention deleted: what it held, for accounting.
CONSUMED = "consumed"
# A mark per training shard the reference audit found suspect (shards/suspects.py): no reader serves it as good.
SUSPECT = "suspect"


def prompts_key(shard_id: str) -> str:
    return f"{PROMPTS}/{shard_id}.jsonl"


def completions_key(shard_id: str) -> str:
    return f"{COMPLETIONS}/{shard_id}.jsonl"


def shard_key(shard_id: str) -> str:
    return f"{SHARDS}/{shard_id}.safetensors"


def epoch_shards_prefix(epoch: int) -> str:
    """Epoch 0's training shards are the run's (`shards/`); a later epoch's lie in a folder of their own."""
    return f"{SHARDS}/" if epoch == 0 else f"{EPOCHS}/{epoch}/{SHARDS}/"


def epoch_shard_key(shard_id: str, epoch: int) -> str:
    return f"{epoch_shards_prefix(epoch)}{shard_id}.safetensors"


def consumed_key(shard_id: str, epoch: int) -> str:
    return f"{CONSUMED}/{epoch}/{shard_id}.json"


def suspect_key(shard_id: str, epoch: int) -> str:
    return f"{SUSPECT}/{epoch}/{shard_id}.json"


def suspect_shard_ids(storage: Listable, epoch: int) -> set[str]:
    """Ids of the training shards of `epoch` marked suspect."""
    return {shard_id_of(key) for key in storage.list(f"{SUSPECT}/{epoch}/") if key.endswith(".json")}


def shard_id_of(key: str) -> str:
    """The shard id of any key above."""
    name = key.rsplit("/", 1)[-1]
    return name.split(".", 1)[0]


def stored_shard_ids(storage: Listable) -> set[str]:
    """Ids of the training shards `storage` holds, or held until every consumer took them (storage.retention =
    "until-consumed"): what counts as done."""
    return {shard_id_of(key) for key in storage.list(SHARDS + "/")} | consumed_shard_ids(storage, 0)


def consumed_shard_ids(storage: Listable, epoch: int) -> set[str]:
    return {shard_id_of(key) for key in storage.list(f"{CONSUMED}/{epoch}/") if key.endswith(".json")}
