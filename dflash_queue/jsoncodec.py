"""JSON through orjson, with the standard library's result wherever the two would differ.

orjson parses and writes several times faster than `json`, but refuses some input `json` accepts (NaN and
Infinity, lone surrogates, non-UTF-8 bytes; integers past 64 bits and non-string keys when writing), reads an
integer past 64 bits as a float, and writes NaN and Infinity as null. Whatever orjson refuses, and any text
with an integer that may be that long, goes to `json` (a long document whose value holds no float at all needs no
look at its text: orjson read every number in it as an int); a value holding a non-finite float is written by
`json`. So every value and every error (a bad record's reason comes from `json.JSONDecodeError`) stays what
the standard library gives. `dumps` writes what `json.dumps(value, ensure_ascii=False, separators=(",", ":"))`
writes, UTF-8 encoded; only floats may be spelt differently (`1e-05` as `0.00001`), never their values. (orjson
also writes UUIDs and plain enums, which `json` refuses; nothing here hands it either.)

`standard_library()` switches every caller to `json` alone, so benchmarks can time both on the same path.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson

# Dataclasses and datetimes go to `json` (which refuses them) instead of being written.
_PLAIN = orjson.OPT_PASSTHROUGH_DATACLASS | orjson.OPT_PASSTHROUGH_DATETIME
_SORTED = _PLAIN | orjson.OPT_SORT_KEYS
_fast = True
# Integers of up to 18 digits fit in 64 bits.
_LONG_RUN = b"\x01" * 19
_LONG_RUN_TEXT = re.compile("[0-9]{19}")
_DIGIT_MASK = bytes(1 if 0x30 <= byte <= 0x39 else 0 for byte in range(256))
# Past this many bytes, looking through the value for a float costs less than scanning the text for digits (shard
# records: a few containers around long strings of text and base64).
_WALK_ABOVE = 2048


@contextmanager
def standard_library() -> Iterator[None]:
    """Encode and decode with `json` alone while inside (the comparison the benchmarks print)."""
    global _fast
    previous, _fast = _fast, False
    try:
        yield
    finally:
        _fast = previous


def loads(data: bytes | memoryview | str) -> Any:
    """One JSON document. Bytes must be UTF-8: `UnicodeDecodeError` otherwise, `json.JSONDecodeError` for bad JSON."""
    if _fast:
        try:
            value = orjson.loads(data)
        except orjson.JSONDecodeError:
            pass
        else:
            if _as_json_reads(data, value):
                return value
    if not isinstance(data, str):
        data = bytes(data).decode("utf-8")
    return json.loads(data)


def _as_json_reads(data: bytes | memoryview | str, value: Any) -> bool:
    """Whether orjson's `value` of `data` is what `json` reads: no integer past 64 bits became a float."""
    if len(data) > _WALK_ABOVE and not _holds_float(value):
        return True
    return not _long_digit_run(data)


def _holds_float(value: Any) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            kinds = set(map(type, item))  # lists of token ids: one pass in C instead of one per element
            if float in kinds:
                return True
            if not kinds <= _SCALARS:
                stack.extend(item)
        elif isinstance(item, float):
            return True
    return False


_SCALARS = {int, str, bool, type(None)}


def _long_digit_run(data: bytes | memoryview | str) -> bool:
    """Whether 19 digits stand in a row: orjson reads an integer past 64 bits as a float, `json` exactly."""
    if isinstance(data, str):
        return _LONG_RUN_TEXT.search(data) is not None
    return _LONG_RUN in bytes(data).translate(_DIGIT_MASK)  # two passes in C, no regex over every byte


def dumps(value: Any, *, sort_keys: bool = False) -> bytes:
    """Compact UTF-8 JSON; raises what `json.dumps` raises (TypeError, ValueError, UnicodeEncodeError)."""
    if _fast:
        try:
            out = orjson.dumps(value, option=_SORTED if sort_keys else _PLAIN)
        except TypeError:  # orjson.JSONEncodeError: big integers, lone surrogates, non-string keys, other types
            pass
        else:
            if b"null" not in out or not _has_non_finite(value):
                return out
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys).encode()


def _has_non_finite(value: Any) -> bool:
    """Whether a NaN or an infinity is anywhere inside (orjson would have written it as null)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            kinds = set(map(type, item))  # lists of token ids: one pass in C instead of one per element
            if kinds <= {int, str, bool, type(None)}:
                continue
            stack.extend(item)
        elif isinstance(item, float) and not math.isfinite(item):
            return True
    return False
