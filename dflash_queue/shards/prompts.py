"""Staged prompt shards: the samples one generate task works on."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from dflash_queue import jsoncodec
from dflash_queue.data.samples import EncodedSample, Sample
from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.jsonl import load_jsonl


def prompt_shard_id(samples: Sequence[Sample | EncodedSample]) -> str:
    """Derived from the sample ids it holds: the same samples always make the same shard."""
    digest = hashlib.sha256()
    for sample in samples:
        digest.update(sample.id.encode())
        digest.update(b"\n")
    return digest.hexdigest()[:20]


def encode_prompts(samples: Sequence[Sample | EncodedSample]) -> bytes:
    """One JSON line per sample; an `EncodedSample` is written as it was encoded."""
    return b"".join(
        [(s.record if isinstance(s, EncodedSample) else jsoncodec.dumps(s.to_json())) + b"\n" for s in samples]
    )


def decode_prompts(data: bytes, *, what: str) -> list[Sample]:
    try:
        return [Sample.from_json(row) for row in load_jsonl(data, what=what)]
    except (KeyError, TypeError) as exc:
        raise ShardFormatError(f"{what}: bad prompt record: {exc!r}") from None
