"""Property tests: random and hostile records never crash the readers, and every record is accounted for."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_queue.data.problems import BadRecord
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import ROLES, Sample

# Text including lone surrogates, NULs, line separators and other trouble.
hostile_text = st.text(alphabet=st.characters(blacklist_categories=()), max_size=40)
json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | hostile_text
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(hostile_text, inner, max_size=4),
    max_leaves=12,
)
roles = st.sampled_from(["human", "gpt", "user", "assistant", "system", "tool", "developer", "wizard", "", "GPT"])
content = hostile_text | json_scalars | st.lists(
    st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"]), "text": hostile_text}), max_size=2
)
sharegpt_turn = st.fixed_dictionaries({"from": roles | json_scalars, "value": content})
openai_turn = st.fixed_dictionaries(
    {"role": roles | json_scalars, "content": content},
    optional={"reasoning_content": hostile_text | st.integers(), "tool_calls": json_values},
)
records = (
    st.fixed_dictionaries({"conversations": st.lists(sharegpt_turn, max_size=6) | json_values},
                          optional={"system": content})
    | st.fixed_dictionaries({"messages": st.lists(openai_turn, max_size=6) | json_values})
    | st.fixed_dictionaries({"prompt": content}, optional={"system": content, "response": content})
    | json_values
)

SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_items(items: list, lines: int, path: Path, unit: str) -> None:
    assert len(items) == lines
    for position, item in enumerate(items):
        expected = position + 1 if unit == "line" else position
        if isinstance(item, BadRecord):
            assert item.file == str(path) and item.line == expected and item.reason
            assert item.unit == unit
            continue
        assert isinstance(item, Sample)
        assert len(item.id) == 32 and int(item.id, 16) >= 0
        assert item.messages and item.messages[-1].role in ("user", "tool")
        for message in item.messages:
            assert message.role in ROLES
            message.content.encode("utf-8")  # nothing that cannot be written to a shard
        # What a sample stages must survive its own format.
        assert Sample.from_json(json.loads(json.dumps(item.to_json()))).id == item.id


def encode_line(record) -> bytes:
    return json.dumps(record, ensure_ascii=True).encode()  # escapes keep every value (surrogates too) one line


@SETTINGS
@given(st.lists(records, min_size=1, max_size=8))
def test_jsonl_records_each_become_a_sample_or_a_bad_record(rows):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.jsonl"
        path.write_bytes(b"\n".join(encode_line(r) for r in rows) + b"\n")
        check_items(list(read_dataset([path], max_record_bytes=1 << 20)), len(rows), path, "line")


@SETTINGS
@given(st.lists(st.binary(min_size=1, max_size=60).filter(lambda b: b"\n" not in b and b.strip()), min_size=1, max_size=8))
def test_random_bytes_lines_never_crash(lines):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.jsonl"
        path.write_bytes(b"\n".join(lines))
        items = list(read_dataset([path], max_record_bytes=40))
        if lines[0].startswith((b"\x1f\x8b", b"\x28\xb5\x2f\xfd", b"PAR1")):
            # Compression or Parquet magic: the file is judged as such and reported as damaged, whole.
            assert len(items) == 1 and isinstance(items[0], BadRecord) and "the rest of the file" in items[0].reason
        else:
            check_items(items, len(lines), path, "line")


@SETTINGS
@given(st.lists(records, max_size=8), st.sampled_from(["last", "all"]))
def test_json_array_elements_each_become_a_sample_or_a_bad_record(rows, regenerate):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.json"
        path.write_text(json.dumps(rows, ensure_ascii=True, indent=1))
        items = list(read_dataset([path], max_record_bytes=1 << 20, regenerate=regenerate))
        if regenerate == "last":
            check_items(items, len(rows), path, "row")
        else:
            assert len(items) == len(rows)
            assert all(isinstance(i, BadRecord) or i.messages[-1].is_slot for i in items)


def test_deeply_nested_json_is_a_bad_record(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 200_000 + "\n" + '{"prompt": "fine"}\n')
    items = list(read_dataset([path], max_record_bytes=1 << 20))
    assert isinstance(items[0], BadRecord) and isinstance(items[1], Sample)
