from __future__ import annotations

import json
from pathlib import Path

from dflash_queue.data.problems import BadRecord, ProblemLog
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample

REPO = Path(__file__).resolve().parents[2]


def write_lines(path: Path, lines: list[str | bytes]) -> Path:
    with open(path, "wb") as handle:
        for line in lines:
            handle.write(line if isinstance(line, bytes) else line.encode())
            handle.write(b"\n")
    return path


def read(path: Path, max_record_bytes: int = 1 << 20) -> tuple[list[Sample], list[BadRecord]]:
    items = list(read_dataset([path], max_record_bytes=max_record_bytes))
    return [i for i in items if isinstance(i, Sample)], [i for i in items if isinstance(i, BadRecord)]


def sharegpt(*turns: tuple[str, str]) -> str:
    return json.dumps({"conversations": [{"from": f, "value": v} for f, v in turns]})


def test_sharegpt_drops_last_assistant_turn_and_keeps_context(tmp_path):
    path = write_lines(
        tmp_path / "d.jsonl",
        [sharegpt(("system", "Be brief."), ("human", "Hi"), ("gpt", "Hello!"), ("human", "2+2?"), ("gpt", "4"))],
    )
    samples, bad = read(path)
    assert bad == []
    [sample] = samples
    assert [(m.role, m.content) for m in sample.messages] == [
        ("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello!"), ("user", "2+2?")
    ]
    assert sample.reference == "4"
    assert sample.source == f"{path}:1"


def test_openai_messages_and_sharegpt_give_the_same_id_for_the_same_prompt(tmp_path):
    openai = json.dumps({"messages": [{"role": "user", "content": "Name a prime."}, {"role": "assistant", "content": "7"}]})
    path = write_lines(tmp_path / "d.jsonl", [sharegpt(("human", "Name a prime.")), openai])
    samples, _ = read(path)
    assert len(samples) == 2
    assert samples[0].id == samples[1].id
    assert len(samples[0].id) == 32


def test_ids_are_stable_and_content_sensitive(tmp_path):
    path = write_lines(tmp_path / "d.jsonl", [sharegpt(("human", "a")), sharegpt(("human", "b"))])
    first, _ = read(path)
    again, _ = read(path)
    assert [s.id for s in first] == [s.id for s in again]
    assert first[0].id != first[1].id


def test_bad_records_are_reported_with_file_line_and_key_and_skipped(tmp_path):
    lines: list[str | bytes] = [
        sharegpt(("human", "fine")),
        "{not json",
        json.dumps({"conversations": [{"from": "wizard", "value": "hi"}]}),
        json.dumps({"conversations": []}),
        sharegpt(("system", "rules"), ("gpt", "unprompted")),
        json.dumps({"messages": [{"role": "user", "content": 5}]}),
        json.dumps([1, 2]),
        json.dumps({"text": "no conversation"}),
        b'{"conversations": [{"from": "human", "value": "\xff\xfe"}]}',
        sharegpt(("human", "x" * 500)),
        sharegpt(("human", "also fine")),
    ]
    path = write_lines(tmp_path / "d.jsonl", lines)
    samples, bad = read(path, max_record_bytes=400)
    assert [s.messages[-1].content for s in samples] == ["fine", "also fine"]
    by_line = {b.line: b for b in bad}
    assert sorted(by_line) == [2, 3, 4, 5, 6, 7, 8, 9, 10]
    assert by_line[2].reason.startswith("malformed JSON")
    assert by_line[3].reason == "unknown role: 'wizard'" and by_line[3].key == "conversations[0].from"
    assert by_line[4].reason == "empty conversation" and by_line[4].key == "conversations"
    assert by_line[5].reason == "no user turn to answer"
    assert by_line[6].key == "messages[0].content" and "must be a string" in by_line[6].reason
    assert by_line[7].reason.startswith("not a JSON object")
    assert by_line[8].reason.startswith("no conversation")
    assert by_line[9].reason.startswith("invalid UTF-8")
    assert by_line[10].reason.startswith("record too large")
    assert str(by_line[3]) == f"{path}:3 [conversations[0].from]: unknown role: 'wizard'"


def test_problem_log_counts_by_kind_and_keeps_examples():
    log = ProblemLog(keep_per_kind=2)
    for line in range(5):
        log.add(BadRecord("f.jsonl", line, f"malformed JSON: bad at column {line}"))
    log.add(BadRecord("f.jsonl", 9, "empty conversation", "conversations"))
    assert log.total == 6
    assert log.counts["malformed JSON"] == 5
    lines = log.lines()
    assert lines[0] == "5 x malformed JSON"
    assert len([line for line in lines if "malformed" in line]) == 3  # the count line and two examples


def test_example_datasets_read_cleanly():
    paths = sorted((REPO / "examples").glob("*.jsonl"))
    assert paths, "examples/ holds the sample datasets"
    samples, bad = read(paths[0])
    samples2, bad2 = read(paths[1])
    assert bad == [] and bad2 == []
    assert len(samples) + len(samples2) >= 50


def test_malformed_json_names_the_column_where_the_line_breaks_off(tmp_path):
    """A record cut short: the error is at the end of its own line, not at column 1 of the next."""
    cut = b'{"conversations": [{"from": "human", "value": "a question"}'  # "]}" missing
    bad_comma = b'{"conversations": [{"from": "human" "value": "x"}]}'
    unterminated = b'{"conversations": [{"from": "human", "value": "a quest'
    path = write_lines(tmp_path / "d.jsonl", [sharegpt(("human", "fine")), cut, bad_comma, unterminated])
    _, bad = read(path, max_record_bytes=1 << 20)
    by_line = {b.line: b.reason for b in bad}
    assert by_line[2] == f"malformed JSON: Expecting ',' delimiter at column {len(cut) + 1} (the end of the line: " \
        "the record is cut short)"
    assert by_line[4] == "malformed JSON: Unterminated string starting at column 47"
    assert by_line[3] == "malformed JSON: Expecting ',' delimiter at column 37"

