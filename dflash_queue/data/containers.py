"""Dataset container formats: JSONL (plain, gzip, zstd), JSON arrays, Parquet -> raw records.

This layer knows files, not conversations: it yields one `RawRecord` (the decoded JSON value of one record)
or one `BadRecord` per record, and never raises on content. `read_raw_records` leaves JSON lines undecoded
(`RawLine`, decoded by `decode_line`), so that staging can parse them in other processes. Where the file itself cannot be read further
(corrupt compressed stream, broken Parquet footer, JSON array syntax error), the bad record says so and the
rest of that file is skipped; other files go on.

Positions: `line` is the 1-based line number in line-oriented files and the 0-based row index in JSON arrays
and Parquet files (`BadRecord.unit` says which).
"""

from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Literal, cast

from dflash_queue import jsoncodec
from dflash_queue.data.problems import BadRecord

Container = Literal["jsonl", "json", "parquet"]
Compression = Literal["none", "gzip", "zstd"]

_GZIP_MAGIC = b"\x1f\x8b"
_ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_PARQUET_MAGIC = b"PAR1"
_LINE_EXTENSIONS = {".jsonl", ".ndjson"}
_COMPRESSION_EXTENSIONS = {".gz", ".gzip", ".zst", ".zstd"}
# Bytes that `surrogateescape` turns undecodable input into.
_ESCAPED_BYTES = re.compile("[\udc80-\udcff]")
_PARQUET_BATCH_ROWS = 4096


@dataclass(frozen=True)
class RawRecord:
    file: str
    line: int
    data: Any
    unit: str = "line"


@dataclass(frozen=True)
class RawLine:
    """One line of a JSON-lines file, not yet decoded."""

    file: str
    line: int
    raw: bytes


@dataclass(frozen=True)
class FileFormat:
    container: Container
    compression: Compression

    def __str__(self) -> str:
        return self.container + ("" if self.compression == "none" else f"+{self.compression}")


def detect_format(path: Path) -> FileFormat:
    """Magic bytes decide compression and Parquet; the extension or the first character decides the rest."""
    with open(path, "rb") as handle:
        head = handle.read(4)
    if head == _PARQUET_MAGIC:
        return FileFormat("parquet", "none")
    compression: Compression = "none"
    if head.startswith(_GZIP_MAGIC):
        compression = "gzip"
    elif head == _ZSTD_MAGIC:
        compression = "zstd"
    suffixes = [s.lower() for s in path.suffixes]
    while suffixes and suffixes[-1] in _COMPRESSION_EXTENSIONS:
        suffixes.pop()
    if suffixes and suffixes[-1] in _LINE_EXTENSIONS:
        return FileFormat("jsonl", compression)
    with _open_text_stream(path, compression) as stream:
        first = _first_significant_byte(stream)
    return FileFormat("json" if first == b"[" else "jsonl", compression)


def read_records(path: str | Path, *, max_record_bytes: int) -> Iterator[RawRecord | BadRecord]:
    """Every record of one file, in file order."""
    for item in read_raw_records(path, max_record_bytes=max_record_bytes):
        if isinstance(item, RawLine):
            decoded = decode_line(item)
            if decoded is not None:
                yield decoded
        else:
            yield item


def read_raw_records(path: str | Path, *, max_record_bytes: int) -> Iterator[RawLine | RawRecord | BadRecord]:
    """Every record of one file, in file order, JSON lines undecoded."""
    path = Path(path)
    name = str(path)
    try:
        fmt = detect_format(path)
    except Exception as exc:  # unreadable file or corrupt header: report it, go on with the next file
        yield BadRecord(name, 0, f"unreadable file: {_describe(exc)}")
        return
    if fmt.container == "parquet":
        yield from _read_parquet(path, max_record_bytes=max_record_bytes)
    elif fmt.container == "json":
        yield from _read_json_array(path, fmt.compression, max_record_bytes=max_record_bytes)
    else:
        yield from _read_jsonl(path, fmt.compression, max_record_bytes=max_record_bytes)


def _describe(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def _open_text_stream(path: Path, compression: Compression) -> IO[bytes]:
    if compression == "gzip":
        return cast(IO[bytes], gzip.open(path, "rb"))
    if compression == "zstd":
        return io.BufferedReader(_ZstdReader(open(path, "rb")), buffer_size=1 << 20)
    return open(path, "rb", buffering=1 << 20)


class _ZstdReader(io.RawIOBase):
    """Decompresses a file of zstd frames and raises EOFError when the file ends inside a frame (a truncated
    file), which zstandard's own stream reader lets pass silently."""

    def __init__(self, raw: IO[bytes]) -> None:
        import zstandard

        self._raw = raw
        self._context = zstandard.ZstdDecompressor()
        self._frame = self._context.decompressobj()
        self._frame_fed = False
        self._out = b""
        self._pos = 0
        self._done = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        while self._pos >= len(self._out) and not self._done:
            chunk = self._raw.read(1 << 20)
            if not chunk:
                if self._frame_fed and not self._frame.eof:
                    raise EOFError("zstd data ended inside a frame")
                self._done = True
                break
            self._out, self._pos = self._feed(chunk), 0
        count = min(len(buffer), len(self._out) - self._pos)
        buffer[:count] = self._out[self._pos : self._pos + count]
        self._pos += count
        return count

    def _feed(self, chunk: bytes) -> bytes:
        out = [self._frame.decompress(chunk)]
        self._frame_fed = True
        while self._frame.eof:
            rest = self._frame.unused_data
            self._frame = self._context.decompressobj()
            self._frame_fed = bool(rest)
            if not rest:
                break
            out.append(self._frame.decompress(rest))
        return b"".join(out)

    def close(self) -> None:
        self._raw.close()
        super().close()


def _first_significant_byte(stream: IO[bytes]) -> bytes:
    while True:
        chunk = stream.read(4096)
        if not chunk:
            return b""
        stripped = chunk.lstrip(b" \t\r\n\xef\xbb\xbf")
        if stripped:
            return stripped[:1]


# Errors a decompressor raises on damaged input, mid-stream.
def _stream_errors() -> tuple[type[BaseException], ...]:
    errors: list[type[BaseException]] = [OSError, EOFError, zlib.error]
    try:
        import zstandard

        errors.append(zstandard.ZstdError)
    except ImportError:  # pragma: no cover - zstandard is a dependency
        pass
    return tuple(errors)


def _read_jsonl(path: Path, compression: Compression, *, max_record_bytes: int) -> Iterator[RawLine | BadRecord]:
    name = str(path)
    line_no = 0
    try:
        with _open_text_stream(path, compression) as stream:
            for line_no, raw, too_large in _bounded_lines(stream, max_record_bytes):
                if too_large:
                    yield BadRecord(name, line_no, f"record too large: {raw} bytes > {max_record_bytes}")
                    continue
                yield RawLine(name, line_no, raw)
    except _stream_errors() as exc:
        what = "corrupt compressed data" if compression != "none" else "read error"
        yield BadRecord(name, line_no + 1, f"{what}: {_describe(exc)}; the rest of the file is skipped")


def _bounded_lines(stream: IO[bytes], limit: int) -> Iterator[tuple[int, Any, bool]]:
    """(line number, bytes, False) per line, or (line number, size, True) for a line longer than `limit`.

    A huge line is never held in memory whole: it is consumed in chunks and only its size is kept.
    """
    line_no = 0
    while True:
        raw = stream.readline(limit + 1)
        if not raw:
            return
        line_no += 1
        if len(raw) > limit and not (len(raw) == limit + 1 and raw.endswith(b"\n")):
            size = len(raw)
            while not raw.endswith(b"\n"):
                raw = stream.readline(1 << 20)
                if not raw:
                    break
                size += len(raw)
            size -= 1 if raw.endswith(b"\n") else 0
            yield line_no, size, True
            continue
        yield line_no, raw, False


def decode_line(item: RawLine) -> RawRecord | BadRecord | None:
    """The record of a line, a bad record for a line that is no JSON, None for a blank line."""
    name, line_no, raw = item.file, item.line, item.raw
    if not raw.strip():
        return None
    # Without its line ending: the parser would place an error at the end of the line on the next one (column 1).
    raw = raw.rstrip(b"\r\n") if isinstance(raw, bytes) else raw
    try:
        return RawRecord(name, line_no, jsoncodec.loads(raw))
    except UnicodeDecodeError as exc:
        return BadRecord(name, line_no, f"invalid UTF-8: {exc.reason} at byte {exc.start}")
    except json.JSONDecodeError as exc:
        at = "" if exc.msg.endswith(" at") else "at "  # "Unterminated string starting at column 47"
        where = f"{at}column {exc.colno}" if exc.lineno == 1 else f"{at}byte {exc.pos} of the line"
        if exc.pos >= len(raw):
            where += " (the end of the line: the record is cut short)"
        return BadRecord(name, line_no, f"malformed JSON: {exc.msg} {where}")
    except RecursionError:
        return BadRecord(name, line_no, "malformed JSON: nested too deeply")


def _read_json_array(
    path: Path, compression: Compression, *, max_record_bytes: int
) -> Iterator[RawRecord | BadRecord]:
    """Elements of a top-level JSON array, decoded one at a time so that one bad element names its row."""
    name = str(path)
    try:
        with _open_text_stream(path, compression) as stream:
            data = stream.read()
    except _stream_errors() as exc:
        yield BadRecord(name, 0, f"corrupt compressed data: {_describe(exc)}; the file is skipped", unit="row")
        return
    # Undecodable bytes survive as lone surrogates and are reported per element, not per file.
    text = data.decode("utf-8", errors="surrogateescape").lstrip("\ufeff")
    decoder = json.JSONDecoder()
    pos = _skip_ws(text, 0)
    if not text.startswith("[", pos):
        yield BadRecord(name, 0, "malformed JSON: expected a top-level array", unit="row")
        return
    pos = _skip_ws(text, pos + 1)
    row = 0
    if text.startswith("]", pos):
        pos += 1
    else:
        while True:
            try:
                value, end = decoder.raw_decode(text, pos)
            except json.JSONDecodeError as exc:
                yield BadRecord(
                    name, row, f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}; "
                    "the rest of the file is skipped", unit="row",
                )
                return
            except RecursionError:
                yield BadRecord(name, row, "malformed JSON: nested too deeply; the rest of the file is skipped", unit="row")
                return
            chunk = text[pos:end]
            if _ESCAPED_BYTES.search(chunk):
                yield BadRecord(name, row, "invalid UTF-8 in record", unit="row")
            else:
                size = len(chunk.encode("utf-8", errors="surrogatepass"))
                if size > max_record_bytes:
                    yield BadRecord(name, row, f"record too large: {size} bytes > {max_record_bytes}", unit="row")
                else:
                    yield RawRecord(name, row, value, unit="row")
            row += 1
            pos = _skip_ws(text, end)
            if text.startswith(",", pos):
                pos = _skip_ws(text, pos + 1)
                continue
            if text.startswith("]", pos):
                pos += 1
                break
            line = text.count("\n", 0, pos) + 1
            yield BadRecord(
                name, row, f"malformed JSON: expected ',' or ']' at line {line}; the rest of the file is skipped",
                unit="row",
            )
            return
    if _skip_ws(text, pos) != len(text):
        yield BadRecord(name, row, "malformed JSON: data after the closing ']' is ignored", unit="row")


def _skip_ws(text: str, pos: int) -> int:
    length = len(text)
    while pos < length and text[pos] in " \t\r\n":
        pos += 1
    return pos


def _read_parquet(path: Path, *, max_record_bytes: int) -> Iterator[RawRecord | BadRecord]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    name = str(path)
    row = 0
    try:
        parquet = pq.ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            for value in batch.to_pylist():
                size = _approx_size(value)
                if size > max_record_bytes:
                    yield BadRecord(name, row, f"record too large: about {size} bytes > {max_record_bytes}", unit="row")
                else:
                    yield RawRecord(name, row, value, unit="row")
                row += 1
    except (pa.ArrowException, OSError, ValueError) as exc:
        yield BadRecord(name, row, f"unreadable Parquet data: {_describe(exc)}; the rest of the file is skipped", unit="row")


def _approx_size(value: Any) -> int:
    """UTF-8 bytes of the strings in a Parquet row plus a little per item: cheap and close to its JSON size."""
    if isinstance(value, str):
        return len(value.encode("utf-8", errors="surrogatepass")) + 2
    if isinstance(value, dict):
        return sum(len(str(k)) + 3 + _approx_size(v) for k, v in value.items()) + 2
    if isinstance(value, (list, tuple)):
        return sum(_approx_size(v) + 1 for v in value) + 2
    if isinstance(value, bytes):
        return len(value)
    return 8
