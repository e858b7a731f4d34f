"""The regenerated dataset as an output: every sample's conversation with the target's own replies.

Teams that train online (the trainer runs the target itself) need only the regenerated conversations; others
want them for SFT or audits. Read from a run's storage, shard by shard (`prompts/` for the conversation,
`completions/` for the exact ids the target generated), so nothing holds the dataset in memory:

* `messages`: OpenAI-messages JSONL, one line per sample: `id`, `messages` (each regenerated reply with its
  reasoning in `reasoning_content`, tool calls and tool results kept), `tools`, `finish_reasons` (one per
  regenerated turn), `thinking`, `quality` (the gate's decision and flags), `source`;
* `parquet`: the same as one Parquet table (a row group per shard; `tool_calls` and `tools` as JSON text), which
  `datasets.load_dataset("parquet", data_files=...)` reads.

Replies are decoded from the stored ids. A reply that began inside a thinking block the prompt opened
(thinking-first templates) or wrote one itself is split at `</think>` into reasoning and answer.
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_queue.data.chat_template import ChatFormatter
from dflash_queue.data.samples import Sample
from dflash_queue.shards.completions import CompletionRecord, decode_completions
from dflash_queue.shards.keys import completions_key, completions_keys, prompts_key, shard_id_of
from dflash_queue.shards.prompts import decode_prompts
from dflash_queue.storage.base import Storage

FILES = {"messages": "conversations.jsonl", "parquet": "conversations.parquet"}


@dataclass
class ConversationReport:
    format: str
    out: str
    samples: int = 0
    shards: int = 0
    decisions: dict[str, int] = field(default_factory=dict)

    def lines(self) -> list[str]:
        decisions = ", ".join(f"{n} {d}" for d, n in sorted(self.decisions.items())) or "none"
        return [
            f"exported:    {self.samples} conversations from {self.shards} shards as {self.format} in "
            f"{self.out}/{FILES[self.format]}",
            f"quality:     {decisions} (every sample is exported; filter on quality.decision or quality.flags)",
        ]


def conversation(sample: Sample, record: CompletionRecord, formatter: ChatFormatter) -> dict[str, Any]:
    """The sample's conversation with each regenerated turn filled in, in order."""
    spans = record.generated_turns()
    replies = iter(spans)
    messages: list[dict[str, Any]] = []
    finish_reasons: list[str] = []
    stopped = False  # a dropped sample ends at the turn the gate dropped
    slots = [m for m in sample.messages if m.is_slot] if sample.regenerate == "all" else []
    for message in sample.messages:
        if message.is_slot and sample.regenerate == "all":
            span = next(replies, None)
            if span is None:
                stopped = True
                break
            messages.append(formatter.reply_message(span.ids, span.start, span.end).to_json())
            finish_reasons.append(span.finish_reason)
        else:
            messages.append(message.to_json())
    if sample.regenerate == "last":
        ids, start, end, reason = spans[-1]
        messages.append(formatter.reply_message(ids, start, end).to_json())
        finish_reasons.append(reason)
    quality = record.quality
    return {
        "id": sample.id,
        "messages": messages,
        "tools": sample.tool_list(),
        "finish_reasons": finish_reasons,
        "complete": not stopped and len(finish_reasons) == max(1, len(slots)),
        "thinking": record.thinking,
        "quality": {"decision": quality.decision, "flags": list(quality.flags)} if quality else
        {"decision": "keep", "flags": []},
        "source": sample.source,
    }


def iter_conversations(storage: Storage, tokenizer) -> Iterator[tuple[str, list[dict[str, Any]]]]:
    """(shard id, its conversations), shard by shard in key order."""
    formatter = ChatFormatter(tokenizer)
    for key in completions_keys(storage):
        shard_id = shard_id_of(key)
        records = {r.id: r for r in decode_completions(storage.read_bytes(completions_key(shard_id)), what=key)}
        samples = decode_prompts(storage.read_bytes(prompts_key(shard_id)), what=prompts_key(shard_id))
        yield shard_id, [conversation(s, records[s.id], formatter) for s in samples if s.id in records]


def export_conversations(
    storage: Storage,
    out: Storage,
    tokenizer,
    format_name: str,
    *,
    on_shard: Callable[[int], None] | None = None,
) -> ConversationReport:
    report = ConversationReport(format_name, out.url)
    writer = _ParquetRows() if format_name == "parquet" else _JsonLines()
    with tempfile.TemporaryDirectory(prefix="dfq-conversations-") as tmp:
        path = Path(tmp) / FILES[format_name]
        with writer.open(path):
            for _, rows in iter_conversations(storage, tokenizer):
                writer.write(rows)
                report.shards += 1
                report.samples += len(rows)
                for row in rows:
                    decision = row["quality"]["decision"]
                    report.decisions[decision] = report.decisions.get(decision, 0) + 1
                if on_shard is not None:
                    on_shard(1)
        out.write_file(FILES[format_name], path)
    return report


class _JsonLines:
    def open(self, path: Path):
        self._file = path.open("w", encoding="utf-8")
        return self._file

    def write(self, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            if row["tools"] is None:
                del row["tools"]
            self._file.write(json.dumps(row, ensure_ascii=False) + "\n")


class _ParquetRows:
    """One row group per shard, a fixed schema (tool calls and tools as JSON text)."""

    def open(self, path: Path):
        import pyarrow as pa
        import pyarrow.parquet as pq

        message = pa.struct(
            [("role", pa.string()), ("content", pa.string()), ("reasoning_content", pa.string()),
             ("tool_calls", pa.string())]
        )
        self._schema = pa.schema(
            [("id", pa.string()), ("messages", pa.list_(message)), ("tools", pa.string()),
             ("finish_reasons", pa.list_(pa.string())), ("complete", pa.bool_()), ("thinking", pa.bool_()),
             ("decision", pa.string()), ("flags", pa.list_(pa.string())), ("source", pa.string())]
        )
        self._writer = pq.ParquetWriter(str(path), self._schema)
        return self._writer

    def write(self, rows: list[dict[str, Any]]) -> None:
        import pyarrow as pa

        if not rows:
            return
        table = pa.Table.from_pylist(
            [
                {
                    "id": row["id"],
                    "messages": [
                        {
                            "role": m["role"],
                            "content": m["content"],
                            "reasoning_content": m.get("reasoning_content"),
                            "tool_calls": json.dumps(m["tool_calls"]) if m.get("tool_calls") is not None else None,
                        }
                        for m in row["messages"]
                    ],
                    "tools": json.dumps(row["tools"]) if row["tools"] is not None else None,
                    "finish_reasons": row["finish_reasons"],
                    "complete": row["complete"],
                    "thinking": row["thinking"],
                    "decision": row["quality"]["decision"],
                    "flags": row["quality"]["flags"],
                    "source": row["source"],
                }
                for row in rows
            ],
            schema=self._schema,
        )
        self._writer.write_table(table)
