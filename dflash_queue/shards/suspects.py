"""The mark beside a training shard the reference audit found suspect (`suspect/{epoch}/{shard id}.json`): its
states may not be the model's (an audit of a shard stored by the same extract worker process failed), so no reader
serves it as good until it is extracted again, which removes the mark.

Kept in storage, beside the shards, so that every reader sees it without the run's broker: the training reader
(`dflash_queue.training`), live training, `export`, `verify` and `inspect`. The broker's record of it
(runstate/audits.py) adds who had consumed it by then.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.keys import suspect_key
from dflash_queue.storage.base import Storage


@dataclass(frozen=True)
class SuspectMark:
    shard_id: str
    epoch: int
    reason: str  # what the failed audit found
    audited: str  # the shard whose audit failed ("" when the worker had been halted before it stored this one)
    node: str  # the extract worker that stored it
    time: float = 0.0

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> SuspectMark:
        try:
            return cls(**json.loads(data))
        except (ValueError, TypeError) as exc:
            raise ShardFormatError(f"{where}: not a suspect-shard mark: {exc}") from None

    def describe(self) -> str:
        found = f"the audit of shard {self.audited}" if self.audited else "its worker had been halted by an audit"
        return f"suspect: stored by {self.node}; {found}: {self.reason}"


def mark_suspect(storage: Storage, mark: SuspectMark) -> None:
    if not mark.time:
        mark = SuspectMark(**{**asdict(mark), "time": time.time()})
    storage.write_bytes(suspect_key(mark.shard_id, mark.epoch), mark.to_json())


def read_mark(storage: Storage, shard_id: str, epoch: int) -> SuspectMark | None:
    key = suspect_key(shard_id, epoch)
    if not storage.exists(key):
        return None
    return SuspectMark.from_json(storage.read_bytes(key), where=key)


def clear_mark(storage: Storage, shard_id: str, epoch: int) -> None:
    key = suspect_key(shard_id, epoch)
    if storage.exists(key):
        storage.delete(key)
