"""What a training shard held, kept when storage.retention = "until-consumed" deleted it once every consumer took it
(`consumed/{epoch}/{shard id}.json`): enough for `verify` to account for its samples and for the producer and the
extract lane to count it done, never to make it again."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.reader import ShardIndex


@dataclass(frozen=True)
class ConsumedShard:
    shard_id: str
    epoch: int
    samples: list[str]  # sample ids, once each (a sample stored as one sequence per turn has several rows)
    flagged: list[str]  # of those, the samples the quality gate flagged
    dropped: list[str]  # samples the quality gate dropped (accounted for in the shard, never extracted)
    num_tokens: int
    consumers: list[str] = field(default_factory=list)
    deleted_at: float = 0.0

    @classmethod
    def of(cls, index: ShardIndex, shard_id: str, epoch: int, consumers: list[str]) -> ConsumedShard:
        first_rows = {sample_id: row for row, sample_id in reversed(list(enumerate(index.sample_ids)))}
        return cls(
            shard_id=shard_id,
            epoch=epoch,
            samples=list(first_rows),
            flagged=[sample_id for sample_id, row in first_rows.items() if index.quality_flags[row]],
            dropped=[entry["id"] for entry in index.dropped],
            num_tokens=index.num_tokens,
            consumers=sorted(consumers),
            deleted_at=time.time(),
        )

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode() + b"\n"

    @classmethod
    def from_json(cls, data: bytes, *, where: str) -> ConsumedShard:
        try:
            fields = json.loads(data)
            return cls(**fields)
        except (ValueError, TypeError) as exc:
            raise ShardFormatError(f"{where}: not a consumed-shard record: {exc}") from None
