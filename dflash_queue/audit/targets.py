"""What an audit PATH holds: dataset files, completions shards, training shards, or a storage root."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from dflash_queue.data.containers import RawRecord, read_records
from dflash_queue.shards.keys import holds_run_output, is_shard_key
from dflash_queue.storage import Storage, open_storage


@dataclass
class Targets:
    datasets: list[Path] = field(default_factory=list)
    completion_files: list[Path] = field(default_factory=list)
    shard_files: list[Path] = field(default_factory=list)
    storages: list[Storage] = field(default_factory=list)

    @property
    def has_outputs(self) -> bool:
        return bool(self.completion_files or self.shard_files or self.storages)


def locate(paths: list[str]) -> Targets:
    targets = Targets()
    for raw in paths:
        if "://" in raw and not Path(raw).exists():
            targets.storages.append(open_storage(raw))
            continue
        path = Path(raw)
        if path.is_dir():
            if holds_run_output(p.name for p in path.iterdir() if p.is_dir()):
                targets.storages.append(open_storage(str(path)))
                continue
            for file in sorted(p for p in path.rglob("*") if p.is_file() and _known(p)):
                _add_file(targets, file)
        else:
            _add_file(targets, path)
    return targets


# Files picked up when a directory is audited (a named file is audited whatever its extension).
DATASET_EXTENSIONS = {".jsonl", ".ndjson", ".json", ".gz", ".gzip", ".zst", ".zstd", ".parquet", ".pq"}


def _known(path: Path) -> bool:
    return not path.name.startswith(".") and (path.suffix.lower() in DATASET_EXTENSIONS or is_shard_key(path.name))


def _add_file(targets: Targets, path: Path) -> None:
    if is_shard_key(path.name):
        targets.shard_files.append(path)
    elif _looks_like_completions(path):
        targets.completion_files.append(path)
    else:
        targets.datasets.append(path)


def _looks_like_completions(path: Path) -> bool:
    """A completions shard is JSONL whose records carry prompt_ids and completion_ids."""
    for item in read_records(path, max_record_bytes=64 * 1024 * 1024):
        return isinstance(item, RawRecord) and isinstance(item.data, dict) and {"prompt_ids", "completion_ids"} <= item.data.keys()
    return False
