"""Staged prompt shards: the samples one generate task works on."""

from __future__ import annotations

import hashlib

from dflash_queue.data.samples import Sample
from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.jsonl import dump_jsonl, load_jsonl


def prompt_shard_id(samples: list[Sample]) -> str:
    """Derived from the sample ids it holds: the same samples always make the same shard."""
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(sample.id.encode())
        digest.update(b"\n")
    return digest.hexdigest()[:20]


def encode_prompts(samples: list[Sample]) -> bytes:
    return dump_jsonl(s.to_json() for s in samples)


def decode_prompts(data: bytes, *, what: str) -> list[Sample]:
    try:
        return [Sample.from_json(row) for row in load_jsonl(data, what=what)]
    except (KeyError, TypeError) as exc:
        raise ShardFormatError(f"{what}: bad prompt record: {exc!r}") from None
