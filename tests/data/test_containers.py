"""Every container format as a real file written here: JSONL, JSON array, gzip/zstd JSONL, Parquet."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from dflash_queue.data.containers import RawRecord, detect_format, read_records
from dflash_queue.data.problems import BadRecord
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample

RECORDS = [
    {"conversations": [{"from": "human", "value": "What is 2+2?"}, {"from": "gpt", "value": "4"}]},
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a prime."}]},
    {"prompt": "Write a haiku about rain.", "system": "You are a poet."},
]


def jsonl_bytes(rows: list) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows).encode()


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def samples_of(path: Path) -> list[Sample]:
    items = list(read_dataset([path], max_record_bytes=1 << 20))
    assert all(isinstance(i, Sample) for i in items), items
    return items  # type: ignore[return-value]


def write_parquet(path: Path, rows: list[dict]) -> Path:
    # One column per key of any row; rows lacking a key hold null there, as in real mixed exports.
    keys = list(dict.fromkeys(k for row in rows for k in row))
    pq.write_table(pa.Table.from_pylist([{k: row.get(k) for k in keys} for row in rows]), path)
    return path


@pytest.fixture
def formats(tmp_path: Path) -> dict[str, Path]:
    return {
        "jsonl": write(tmp_path / "d.jsonl", jsonl_bytes(RECORDS)),
        "json": write(tmp_path / "d.json", json.dumps(RECORDS, indent=2).encode()),
        "gzip": write(tmp_path / "d.jsonl.gz", gzip.compress(jsonl_bytes(RECORDS))),
        "zstd": write(tmp_path / "d.jsonl.zst", zstandard.ZstdCompressor().compress(jsonl_bytes(RECORDS))),
        "json+gzip": write(tmp_path / "d.json.gz", gzip.compress(json.dumps(RECORDS).encode())),
        # Mixed schemas in one Parquet file: absent struct fields come back as None and must not matter.
        "parquet": write_parquet(tmp_path / "d.parquet", RECORDS),
        "unnamed": write(tmp_path / "data.bin", gzip.compress(jsonl_bytes(RECORDS))),
    }


def test_every_container_gives_the_same_samples(formats):
    reference = samples_of(formats["jsonl"])
    assert [s.messages[-1].content for s in reference] == ["What is 2+2?", "Name a prime.", "Write a haiku about rain."]
    for name, path in formats.items():
        got = samples_of(path)
        assert [s.id for s in got] == [s.id for s in reference], name


def test_format_detection_uses_magic_bytes_then_extension_then_content(formats):
    assert str(detect_format(formats["jsonl"])) == "jsonl"
    assert str(detect_format(formats["json"])) == "json"
    assert str(detect_format(formats["gzip"])) == "jsonl+gzip"
    assert str(detect_format(formats["zstd"])) == "jsonl+zstd"
    assert str(detect_format(formats["json+gzip"])) == "json+gzip"
    assert str(detect_format(formats["parquet"])) == "parquet"
    assert str(detect_format(formats["unnamed"])) == "jsonl+gzip"


def test_sources_name_line_or_row(formats):
    assert samples_of(formats["jsonl"])[1].source == f"{formats['jsonl']}:2"
    assert samples_of(formats["json"])[1].source == f"{formats['json']}#1"
    assert samples_of(formats["parquet"])[2].source == f"{formats['parquet']}#2"


def test_json_array_bad_elements_are_reported_by_row_and_the_rest_read(tmp_path):
    text = b'[{"prompt": "one"}, {"prompt": "bad \xff byte"}, 7, {"prompt": "' + b"x" * 300 + b'"}, {"prompt": "two"}]'
    path = write(tmp_path / "a.json", text)
    items = list(read_dataset([path], max_record_bytes=200))
    samples = [i for i in items if isinstance(i, Sample)]
    bad = {b.line: b for b in items if isinstance(b, BadRecord)}
    assert [s.messages[0].content for s in samples] == ["one", "two"]
    assert bad[1].reason == "invalid UTF-8 in record" and bad[1].unit == "row"
    assert bad[2].reason.startswith("not a JSON object")
    assert bad[3].reason.startswith("record too large")
    assert str(bad[2]) == f"{path} row 2: not a JSON object: got int"


def test_json_array_syntax_error_keeps_what_came_before(tmp_path):
    path = write(tmp_path / "a.json", b'[\n{"prompt": "one"},\n{"prompt": "two"\n, {"prompt": "three"}]')
    items = list(read_records(path, max_record_bytes=1 << 20))
    assert isinstance(items[0], RawRecord) and items[0].data == {"prompt": "one"}
    assert isinstance(items[1], BadRecord) and items[1].line == 1
    assert "malformed JSON" in items[1].reason and "line 4" in items[1].reason and "rest of the file" in items[1].reason
    assert len(items) == 2


@pytest.mark.parametrize("compress, suffix", [(gzip.compress, ".gz"), (zstandard.ZstdCompressor().compress, ".zst")])
def test_truncated_compressed_file_reports_where_it_broke_and_keeps_earlier_records(tmp_path, compress, suffix):
    rows = [{"prompt": f"question {i} " + "pad " * 200} for i in range(200)]
    data = compress(jsonl_bytes(rows))
    path = write(tmp_path / f"cut.jsonl{suffix}", data[: len(data) // 2])
    items = list(read_dataset([path], max_record_bytes=1 << 20))
    assert isinstance(items[-1], BadRecord)
    assert items[-1].reason.startswith("corrupt compressed data") and "rest of the file" in items[-1].reason
    good = [i for i in items if isinstance(i, Sample)]
    assert len(good) < 200 and items[-1].line == len(good) + 1
    assert all(s.messages[0].content.startswith(f"question {n} ") for n, s in enumerate(good))


def test_corrupt_parquet_and_missing_file_are_bad_records_not_crashes(tmp_path):
    broken = write(tmp_path / "x.parquet", b"PAR1" + b"\x00" * 64)
    missing = tmp_path / "nowhere.jsonl"
    fine = write(tmp_path / "ok.jsonl", jsonl_bytes([{"prompt": "still read"}]))
    items = list(read_dataset([broken, missing, fine], max_record_bytes=1 << 20))
    assert [type(i).__name__ for i in items] == ["BadRecord", "BadRecord", "Sample"]
    assert "Parquet" in items[0].reason and items[1].reason.startswith("unreadable file")


def test_a_huge_line_is_measured_not_loaded(tmp_path):
    path = tmp_path / "big.jsonl"
    with open(path, "wb") as handle:
        handle.write(b'{"prompt": "small"}\n')
        handle.write(b'{"prompt": "' + b"y" * (5 << 20) + b'"}\n')
        handle.write(b'{"prompt": "after"}')  # no final newline
    items = list(read_dataset([path], max_record_bytes=1024))
    assert [type(i).__name__ for i in items] == ["Sample", "BadRecord", "Sample"]
    assert items[1].reason == f"record too large: {(5 << 20) + 14} bytes > 1024" and items[1].line == 2


def test_parquet_string_encoded_turns_and_row_size_limit(tmp_path):
    rows = [
        {"conversations": json.dumps([{"from": "human", "value": "hello there"}])},
        {"conversations": "[not json"},
        {"conversations": json.dumps([{"from": "human", "value": "z" * 5000}])},
    ]
    path = write_parquet(tmp_path / "s.parquet", rows)
    items = list(read_dataset([path], max_record_bytes=2000))
    assert isinstance(items[0], Sample) and items[0].messages[0].content == "hello there"
    assert items[1].key == "conversations" and "malformed JSON" in items[1].reason
    assert items[2].reason.startswith("record too large") and items[2].line == 2
