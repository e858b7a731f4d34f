"""Dataset readers: ShareGPT and OpenAI-messages JSONL into samples, bad records into reports.

Readers never raise on content. Every record becomes either a `Sample` or a `BadRecord` naming the file,
the line and, where one is to blame, the key.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_queue.data.problems import BadRecord
from dflash_queue.data.samples import Message, Sample, sample_id

SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
}
OPENAI_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class RecordError(ValueError):
    """A record that cannot become a sample; `key` points at the offending field."""

    def __init__(self, reason: str, key: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.key = key


@dataclass(frozen=True)
class RawRecord:
    file: str
    line: int
    data: Any


def read_dataset(paths: Iterable[str | Path], *, max_record_bytes: int) -> Iterator[Sample | BadRecord]:
    """Samples and bad records from the files, in file order."""
    for path in paths:
        for item in _read_jsonl(Path(path), max_record_bytes=max_record_bytes):
            if isinstance(item, BadRecord):
                yield item
                continue
            try:
                messages = parse_conversation(item.data)
                yield to_sample(messages, source=f"{item.file}:{item.line}")
            except RecordError as exc:
                yield BadRecord(item.file, item.line, exc.reason, exc.key)


def _read_jsonl(path: Path, *, max_record_bytes: int) -> Iterator[RawRecord | BadRecord]:
    name = str(path)
    with open(path, "rb") as handle:
        for line_no, raw in enumerate(handle, start=1):
            if len(raw) > max_record_bytes:
                yield BadRecord(name, line_no, f"record too large: {len(raw)} bytes > {max_record_bytes}")
                continue
            if not raw.strip():
                continue
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield BadRecord(name, line_no, f"invalid UTF-8: {exc.reason} at byte {exc.start}")
                continue
            try:
                data = json.loads(text)
            except json.JSONDecodeError as exc:
                yield BadRecord(name, line_no, f"malformed JSON: {exc.msg} at column {exc.colno}")
                continue
            yield RawRecord(name, line_no, data)


def parse_conversation(data: Any) -> list[Message]:
    """Normalised messages of a ShareGPT (`conversations`) or OpenAI (`messages`) record."""
    if not isinstance(data, dict):
        raise RecordError(f"not a JSON object: got {type(data).__name__}")
    if "conversations" in data:
        return _parse_turns(data["conversations"], "conversations", "from", "value", SHAREGPT_ROLES)
    if "messages" in data:
        return _parse_turns(data["messages"], "messages", "role", "content", OPENAI_ROLES)
    raise RecordError("no conversation: expected a 'conversations' or 'messages' list")


def _parse_turns(
    turns: Any, field: str, role_key: str, content_key: str, roles: dict[str, str]
) -> list[Message]:
    if not isinstance(turns, list):
        raise RecordError(f"wrong type: expected a list, got {type(turns).__name__}", field)
    if not turns:
        raise RecordError("empty conversation", field)
    messages = []
    for index, turn in enumerate(turns):
        where = f"{field}[{index}]"
        if not isinstance(turn, dict):
            raise RecordError(f"wrong type: expected an object, got {type(turn).__name__}", where)
        role = turn.get(role_key)
        if not isinstance(role, str):
            raise RecordError(f"missing or non-string role: {role!r}", f"{where}.{role_key}")
        if role.lower() not in roles:
            raise RecordError(f"unknown role: {role!r}", f"{where}.{role_key}")
        content = turn.get(content_key)
        if not isinstance(content, str):
            raise RecordError(
                f"wrong type: content must be a string, got {type(content).__name__}", f"{where}.{content_key}"
            )
        if not content.strip() and roles[role.lower()] == "user":
            raise RecordError("empty content", f"{where}.{content_key}")
        messages.append(Message(roles[role.lower()], content))  # type: ignore[arg-type]
    return messages


def to_sample(messages: list[Message], *, source: str) -> Sample:
    """The prompt to regenerate from: the conversation without its last assistant turn.

    Earlier assistant turns stay as context; a conversation that ends on a user turn is a prompt as it is.
    """
    reference = None
    if messages and messages[-1].role == "assistant":
        reference = messages[-1].content
        messages = messages[:-1]
    if not any(m.role == "user" for m in messages):
        raise RecordError("no user turn to answer")
    if messages[-1].role != "user":
        raise RecordError(f"conversation ends on a {messages[-1].role} turn, not a user turn")
    prompt = tuple(messages)
    return Sample(id=sample_id(prompt), messages=prompt, source=source, reference=reference)
