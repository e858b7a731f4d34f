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
    # Split on the newlines dump_jsonl writes, nothing else: JSON leaves U+2028 or U+0085 in text unescaped.
    for line_no, line in enumerate(data.split(b"\n"), start=1):
        if not line.strip():
            continue
        try:
            rows.append((line_no, jsoncodec.loads(line)))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            reason = exc.msg if isinstance(exc, json.JSONDecodeError) else f"invalid UTF-8 at byte {exc.start}"
            raise ShardFormatError(f"{what}:{line_no}: corrupt JSON line: {reason}") from None
    return rows
