"""orjson with the standard library's results: same values, same errors, same bytes where bytes matter."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_queue import jsoncodec
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Message, sample_id

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"

# Every code point, surrogates included: what a dataset's escapes can produce.
any_text = st.text(alphabet=st.characters(blacklist_categories=()), max_size=30)
valid_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30)
scalars = (
    st.none() | st.booleans() | st.integers() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats() | any_text
)
values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4), max_leaves=16
)
SETTINGS = settings(max_examples=400, deadline=None)


def stdlib_dumps(value, sort_keys=False) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), sort_keys=sort_keys).encode()


def outcome(call):
    try:
        return "ok", call()
    except Exception as exc:  # the type and message a caller turns into a bad record
        return type(exc).__name__, str(exc)


def same_value(a, b) -> bool:
    """Equality that also holds for NaN and tells 1 from 1.0 and True, -0.0 from 0.0."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if type(a) is not type(b):
        return False
    if isinstance(a, list):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same_value(a[k], b[k]) for k in a)
    return a == b


@SETTINGS
@given(values)
def test_loads_gives_what_json_gives_for_any_value(value):
    for text in (json.dumps(value), json.dumps(value, ensure_ascii=False, separators=(",", ":"))):
        data = text.encode("utf-8", errors="surrogatepass")
        expected = outcome(lambda data=data: json.loads(data.decode("utf-8")))
        got = outcome(lambda data=data: jsoncodec.loads(data))
        assert got[0] == expected[0]
        assert same_value(got[1], expected[1]) if got[0] == "ok" else got == expected


@SETTINGS
@given(st.binary(max_size=40) | st.sampled_from([
    b'{"a": NaN}', b"[Infinity, -Infinity]", b"123456789012345678901234567890", b'"\\ud800"', b"\xef\xbb\xbf{}",
    b'{"a": 1, "a": 2}', b"[1e400]", b"-0.0", b"[" * 2000 + b"]" * 2000, b'{"a": "\x01"}', b"1.5e-7", b"\xff{}",
    b"-9223372036854775809", b"18446744073709551616", b"0.1000000000000000055511151231257827021181583404541015625",
    b"2.2250738585072011e-308", b"4.9406564584124654e-324", b"1e-400", b"1.7976931348623159e308", '"\\u2028 \u2028 \x85"'.encode(),
]) | st.from_regex(rb"\A-?(0|[1-9][0-9]{0,24})(\.[0-9]{1,24})?([eE][-+]?[0-9]{1,3})?\Z"))
def test_loads_gives_what_json_gives_for_any_bytes(data):
    def stdlib():
        return json.loads(data.decode("utf-8"))

    expected, got = outcome(stdlib), outcome(lambda: jsoncodec.loads(data))
    assert got[0] == expected[0]
    assert same_value(got[1], expected[1]) if got[0] == "ok" else got == expected


@SETTINGS
@given(values)
def test_loads_gives_what_json_gives_for_long_documents(value):
    """Past a few kilobytes, loads looks through orjson's value for floats instead of scanning the text."""
    padding = "x" * (jsoncodec._WALK_ABOVE + 1)
    for document in ([padding, value], {"text": padding, "value": [value, [1, 2, value]]}):
        data = json.dumps(document, ensure_ascii=False).encode("utf-8", errors="surrogatepass")
        expected = outcome(lambda data=data: json.loads(data.decode("utf-8")))
        got = outcome(lambda data=data: jsoncodec.loads(memoryview(data)))
        assert got[0] == expected[0]
        assert same_value(got[1], expected[1]) if got[0] == "ok" else got == expected


def test_long_documents_with_integers_past_64_bits_read_exactly():
    padding = "x" * (jsoncodec._WALK_ABOVE + 1)
    for big in (2**64, -(2**63) - 1, 10**30):
        assert jsoncodec.loads(json.dumps({"text": padding, "n": [[1, big]]}).encode())["n"] == [[1, big]]


no_floats = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70) | any_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(any_text, inner, max_size=4),
    max_leaves=16,
)


@SETTINGS
@given(no_floats, st.booleans())
def test_dumps_writes_json_bytes_for_values_without_floats(value, sort_keys):
    assert outcome(lambda: jsoncodec.dumps(value, sort_keys=sort_keys)) == outcome(
        lambda: stdlib_dumps(value, sort_keys)
    )


@SETTINGS
@given(values)
def test_dumps_keeps_every_value_json_keeps(value):
    expected = outcome(lambda: stdlib_dumps(value))
    got = outcome(lambda: jsoncodec.dumps(value))
    assert got[0] == expected[0]
    if got[0] == "ok":
        assert same_value(json.loads(got[1]), json.loads(expected[1]))


def test_non_finite_floats_and_other_refusals_are_written_by_json():
    assert jsoncodec.dumps({"x": [1, {"y": float("nan")}], "z": None}) == b'{"x":[1,{"y":NaN}],"z":null}'
    assert jsoncodec.dumps([float("-inf"), None]) == b"[-Infinity,null]"
    assert jsoncodec.dumps({1: 2**64}) == b'{"1":18446744073709551616}'
    with pytest.raises(UnicodeEncodeError):
        jsoncodec.dumps(["\ud800"])


def test_standard_library_switch_runs_json_alone():
    assert jsoncodec.dumps([1e-05]) == b"[0.00001]"  # orjson's spelling
    with jsoncodec.standard_library():
        assert jsoncodec.dumps([1e-05]) == b"[1e-05]"
        with pytest.raises(json.JSONDecodeError, match="Expecting value"):
            jsoncodec.loads(b"[")
    assert jsoncodec.dumps([1e-05]) == b"[0.00001]"


def old_sample_id(messages: tuple[Message, ...], tools: str | None = None) -> str:
    """The id as the standard library always computed it."""
    rows: list[list[str]] = [["tools", tools]] if tools is not None else []
    for m in messages:
        row = [m.role, m.content]
        if m.reasoning is not None or m.tool_calls is not None:
            row += [m.reasoning or "", m.tool_calls or ""]
        rows.append(row)
    canonical = json.dumps(rows, ensure_ascii=False, separators=(",", ":"))
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()[:32]


messages = st.lists(
    st.builds(Message, st.sampled_from(["system", "user", "assistant", "tool"]), valid_text,
              st.none() | valid_text, st.none() | valid_text),
    min_size=1, max_size=5,
).map(tuple)


@SETTINGS
@given(messages, st.none() | valid_text)
def test_sample_ids_hash_the_bytes_json_wrote(conversation, tools):
    assert sample_id(conversation, tools) == old_sample_id(conversation, tools)


def test_sample_ids_of_non_ascii_and_escaped_text():
    for text in ["naïve café", "数据 ✓ → 🙂", "tab\tnew\nline\r\x00\x1f\x7f", "quote \" back \\ slash", "\u2028\u2029\x85",
                 "</think>", "\ufeffbom"]:
        conversation = (Message("system", text), Message("user", text, text, text))
        assert sample_id(conversation, text) == old_sample_id(conversation, text)


@pytest.mark.parametrize("regenerate", ["last", "all"])
def test_example_datasets_keep_their_sample_ids(regenerate):
    paths = sorted(EXAMPLES.glob("*.jsonl"))
    assert paths
    fast = list(read_dataset(paths, max_record_bytes=1 << 24, regenerate=regenerate))
    with jsoncodec.standard_library():
        stdlib = list(read_dataset(paths, max_record_bytes=1 << 24, regenerate=regenerate))
    assert len(fast) == len(stdlib) > 50
    assert [getattr(item, "id", item) for item in fast] == [getattr(item, "id", item) for item in stdlib]
    assert fast == stdlib
