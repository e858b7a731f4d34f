"""Storage key layout: the one place that spells the run's storage keys (tests/shards/test_keys.py fails on a
prefix or suffix spelt elsewhere). Keys derive from shard ids only, so a re-delivered task writes the same keys."""

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
# The file suffixes: prompt and completion records (JSON lines), training shards, per-shard marks and records.
RECORDS_SUFFIX = ".jsonl"
SHARD_SUFFIX = ".safetensors"
MARK_SUFFIX = ".json"


def prompts_key(shard_id: str) -> str:
    return f"{PROMPTS}/{shard_id}{RECORDS_SUFFIX}"


def completions_key(shard_id: str) -> str:
    return f"{COMPLETIONS}/{shard_id}{RECORDS_SUFFIX}"


def shard_key(shard_id: str) -> str:
    return f"{SHARDS}/{shard_id}{SHARD_SUFFIX}"


def is_shard_key(key: str) -> bool:
    """Whether `key` (or a URL or path) names a training shard file."""
    return key.endswith(SHARD_SUFFIX)


def prompts_keys(storage: Listable) -> list[str]:
    """The prompt shards' keys, in key order."""
    return sorted(k for k in storage.list(f"{PROMPTS}/") if k.endswith(RECORDS_SUFFIX))


def completions_keys(storage: Listable) -> list[str]:
    """The completions shards' keys, in key order."""
    return sorted(k for k in storage.list(f"{COMPLETIONS}/") if k.endswith(RECORDS_SUFFIX))


def completed_shard_ids(storage: Listable) -> list[str]:
    """Ids of the shards whose completions `storage` holds, in order."""
    return sorted({shard_id_of(key) for key in completions_keys(storage)})


def run_shard_keys(storage: Listable) -> list[str]:
    """The run's own (epoch 0) training shards' keys, in key order."""
    return sorted(k for k in storage.list(f"{SHARDS}/") if is_shard_key(k))


def epoch_shard_keys(storage: Listable, epoch: int) -> list[str]:
    """The training shards' keys of `epoch`, in key order."""
    return sorted(k for k in storage.list(epoch_shards_prefix(epoch)) if is_shard_key(k))


def in_later_epoch(key: str) -> bool:
    """Whether `key` lies under a later epoch's folder (`epochs/N/...`)."""
    return key.startswith(f"{EPOCHS}/")


def holds_run_output(directory_names: Iterable[str]) -> bool:
    """Whether a folder holding these entries is a run's storage root (it has training shards or completions)."""
    return bool({SHARDS, COMPLETIONS} & set(directory_names))


def holds_anything_made(storage: Listable) -> bool:
    """Whether `storage` holds anything a run made beyond staged prompts: completions, training shards (of any
    epoch) or records of consumed ones."""
    return any(next(iter(storage.list(f"{prefix}/")), None) is not None for prefix in (COMPLETIONS, SHARDS, EPOCHS,
                                                                                        CONSUMED))


def shards_location(storage_url: str) -> str:
    """Where a run's training shards lie, for people: the run's storage URL and its shards folder."""
    return f"{storage_url.rstrip('/')}/{SHARDS}/"


def consumed_location(storage_url: str, epoch: int = 0) -> str:
    """Where the records of an epoch's consumed training shards lie, for people."""
    return f"{storage_url.rstrip('/')}/{CONSUMED}/{epoch}/"


def split_shard_path(segments: list[str]) -> tuple[list[str], int, str] | None:
    """(root segments, epoch, shard id) of a path whose last segments are `shards/{id}.safetensors`, under
    `epochs/{n}/` for a later epoch; None for any other path."""
    if len(segments) < 2 or segments[-2] != SHARDS or not is_shard_key(segments[-1]):
        return None
    shard_id = segments[-1][: -len(SHARD_SUFFIX)]
    if len(segments) >= 4 and segments[-4] == EPOCHS and segments[-3].isdigit():
        return segments[:-4], int(segments[-3]), shard_id
    return segments[:-2], 0, shard_id


def epoch_shards_prefix(epoch: int) -> str:
    """Epoch 0's training shards are the run's (`shards/`); a later epoch's lie in a folder of their own."""
    return f"{SHARDS}/" if epoch == 0 else f"{EPOCHS}/{epoch}/{SHARDS}/"


def epoch_shard_key(shard_id: str, epoch: int) -> str:
    return f"{epoch_shards_prefix(epoch)}{shard_id}.safetensors"


def consumed_key(shard_id: str, epoch: int) -> str:
    return f"{CONSUMED}/{epoch}/{shard_id}{MARK_SUFFIX}"


def consumed_keys(storage: Listable, epoch: int) -> list[str]:
    """The consumed records' keys of `epoch`, in key order."""
    return sorted(k for k in storage.list(f"{CONSUMED}/{epoch}/") if k.endswith(MARK_SUFFIX))


def suspect_key(shard_id: str, epoch: int) -> str:
    return f"{SUSPECT}/{epoch}/{shard_id}{MARK_SUFFIX}"


def suspect_marks_prefix(root_prefix: str = "") -> str:
    """The prefix of every suspect mark of the run whose root is at `root_prefix` in its storage."""
    return f"{root_prefix}{SUSPECT}/"


def suspect_mark_of(key: str) -> tuple[int, str] | None:
    """(epoch, shard id) of a suspect mark's key; None for any other key."""
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == SUSPECT and parts[1].isdigit() and key.endswith(MARK_SUFFIX):
        return int(parts[1]), shard_id_of(key)
    return None


def suspect_shard_ids(storage: Listable, epoch: int) -> set[str]:
    """Ids of the training shards of `epoch` marked suspect."""
    return {shard_id_of(key) for key in storage.list(f"{SUSPECT}/{epoch}/") if key.endswith(MARK_SUFFIX)}


def shard_id_of(key: str) -> str:
    """The shard id of any key above."""
    name = key.rsplit("/", 1)[-1]
    return name.split(".", 1)[0]


def stored_shard_ids(storage: Listable) -> set[str]:
    """Ids of the training shards `storage` holds, or held until every consumer took them (storage.retention =
    "until-consumed"): what counts as done."""
    return {shard_id_of(key) for key in storage.list(SHARDS + "/")} | consumed_shard_ids(storage, 0)


def consumed_shard_ids(storage: Listable, epoch: int) -> set[str]:
    return {shard_id_of(key) for key in consumed_keys(storage, epoch)}
