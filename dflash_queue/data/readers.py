"""Dataset readers: files of any supported container and schema -> samples, bad records -> reports.

Containers (`containers.py`): JSONL, gzip/zstd JSONL, JSON arrays, Parquet. Schemas (`schemas.py`): ShareGPT,
OpenAI messages, plain prompts. What gets regenerated (`selection.py`): the last assistant turn, or all.

Readers never raise on content. Every record becomes either a `Sample` or a `BadRecord` naming the file,
the line (or row) and, where one is to blame, the key.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from dflash_queue.data.containers import RawRecord, read_records
from dflash_queue.data.problems import BadRecord
from dflash_queue.data.samples import Regenerate, Sample
from dflash_queue.data.schemas import Conversation, RecordError, parse_record
from dflash_queue.data.selection import to_sample

__all__ = ["ConversationRecord", "RecordError", "read_conversations", "read_dataset"]


@dataclass(frozen=True)
class ConversationRecord:
    conversation: Conversation
    file: str
    line: int
    unit: str = "line"

    @property
    def source(self) -> str:
        return f"{self.file}:{self.line}" if self.unit == "line" else f"{self.file}#{self.line}"


def read_conversations(paths: Iterable[str | Path], *, max_record_bytes: int) -> Iterator[ConversationRecord | BadRecord]:
    """Normalised conversations and bad records from the files, in file order."""
    for path in paths:
        for item in read_records(path, max_record_bytes=max_record_bytes):
            yield item if isinstance(item, BadRecord) else conversation_of(item)


def read_dataset(
    paths: Iterable[str | Path], *, max_record_bytes: int, regenerate: Regenerate = "last"
) -> Iterator[Sample | BadRecord]:
    """Samples and bad records from the files, in file order."""
    for path in paths:
        for item in read_records(path, max_record_bytes=max_record_bytes):
            yield item if isinstance(item, BadRecord) else sample_of(item, regenerate)


def conversation_of(item: RawRecord) -> ConversationRecord | BadRecord:
    try:
        return ConversationRecord(parse_record(item.data), item.file, item.line, item.unit)
    except RecordError as exc:
        return _bad(item, exc)
    except RecursionError:
        return BadRecord(item.file, item.line, "record nested too deeply", unit=item.unit)


def sample_of(item: RawRecord, regenerate: Regenerate = "last") -> Sample | BadRecord:
    """The sample of one record, or the bad record that says why there is none."""
    record = conversation_of(item)
    if isinstance(record, BadRecord):
        return record
    try:
        return to_sample(record.conversation, source=record.source, regenerate=regenerate)
    except RecordError as exc:
        return _bad(item, exc)


def _bad(item: RawRecord, exc: RecordError) -> BadRecord:
    return BadRecord(item.file, item.line, exc.reason, exc.key, unit=item.unit)
