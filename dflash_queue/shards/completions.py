"""A generated reply with the exact token ids the engine produced."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.jsonl import dump_jsonl, load_jsonl


@dataclass(frozen=True)
class CompletionRecord:
    id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    finish_reason: str
    thinking: bool
    text: str
    source: str = ""

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.completion_ids)

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "prompt_ids": self.prompt_ids,
            "completion_ids": self.completion_ids,
            "finish_reason": self.finish_reason,
            "thinking": self.thinking,
            "text": self.text,
            "source": self.source,
        }

    @classmethod
    def from_json(cls, row: dict[str, Any]) -> CompletionRecord:
        try:
            return cls(
                id=row["id"],
                prompt_ids=[int(t) for t in row["prompt_ids"]],
                completion_ids=[int(t) for t in row["completion_ids"]],
                finish_reason=row["finish_reason"],
                thinking=bool(row["thinking"]),
                text=row.get("text", ""),
                source=row.get("source", ""),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ShardFormatError(f"completion record {row.get('id', '?')}: {exc!r}") from None


def encode_completions(records: list[CompletionRecord]) -> bytes:
    return dump_jsonl(r.to_json() for r in records)


def decode_completions(data: bytes, *, what: str) -> list[CompletionRecord]:
    return [CompletionRecord.from_json(row) for row in load_jsonl(data, what=what)]
