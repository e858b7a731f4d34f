"""JSON-lines encoding of staged prompts and completions."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from dflash_queue.errors import ShardFormatError


def dump_jsonl(rows: Iterable[dict[str, Any]]) -> bytes:
    return "".join(json.dumps(row, ensure_ascii=False, separators=(",", ":")) + "\n" for row in rows).encode()


def load_jsonl(data: bytes, *, what: str) -> list[dict[str, Any]]:
    rows = []
    for line_no, line in enumerate(data.decode("utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise ShardFormatError(f"{what}:{line_no}: corrupt JSON line: {exc.msg}") from None
    return rows
