"""JSON-lines encoding of staged prompts and completions."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from dflash_queue import jsoncodec
from dflash_queue.errors import ShardFormatError


def dump_jsonl(rows: Iterable[dict[str, Any]]) -> bytes:
    return b"".join([jsoncodec.dumps(row) + b"\n" for row in rows])


def load_jsonl(data: bytes, *, what: str) -> list[dict[str, Any]]:
    return [row for _, row in load_numbered_jsonl(data, what=what)]


def load_numbered_jsonl(data: bytes, *, what: str) -> list[tuple[int, dict[str, Any]]]:
    """Each row with its line number (blank lines skipped); ShardFormatError names `what` and the line."""
    rows = []
    view = memoryview(data)  # lines are parsed in place: a shard of long records is never copied line by line
    begin, size, line_no = 0, len(data), 0
    while begin < size:
        line_no += 1
        # Split on the newlines dump_jsonl writes, nothing else: JSON leaves U+2028 or U+0085 in text unescaped.
        end = data.find(b"\n", begin)
        if end < 0:
            end = size
        line = view[begin:end]
        blank = begin == end or (data[begin] in _WHITESPACE and data[begin:end].isspace())
        begin = end + 1
        if blank:
            continue
        try:
            rows.append((line_no, jsoncodec.loads(line)))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else f"invalid UTF-8 at byte {exc.start}"
            raise ShardFormatError(f"{what}:{line_no}: corrupt JSON line: {reason}") from None
    return rows


_WHITESPACE = frozenset(b" \t\r\x0b\x0c")
