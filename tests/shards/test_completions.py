from __future__ import annotations

import binascii
import json
from contextlib import nullcontext

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_queue import jsoncodec
from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.completions import (
    CompletionRecord,
    ServedTurn,
    TurnSpan,
    decode_completions,
    encode_completions,
    encode_token_ids,
    token_ids,
)
from dflash_queue.shards.verdicts import Verdict

# Largest vocabularies are ~260k; uint32 holds every id up to 2**32 - 1.
IDS = [0, 1, 151_643, 262_143, 2**32 - 1]


def record(**changes) -> CompletionRecord:
    fields = dict(
        id="s1", prompt_ids=[7, 8, 9, 10], completion_ids=[11, 2**31], finish_reason="stop", thinking=True,
        text="réponse ✓", source="d.jsonl:3", earlier_turns=(TurnSpan(1, 3, "stop"),),
        quality=Verdict("keep", ("loop",), (), 5, "closed"),
        served_turns=(ServedTurn([1, 2], [3, 262_143], "length"),),
    )
    fields.update(changes)
    return CompletionRecord(**fields)


def test_token_ids_are_stored_as_little_endian_uint32_base64():
    # bytes 01 00 00 00 02 00 00 00
    assert encode_token_ids([1, 2]) == "AQAAAAIAAAA="
    assert encode_token_ids([]) == ""
    assert token_ids("AQAAAAIAAAA=") == [1, 2]
    assert token_ids(encode_token_ids(IDS)) == IDS
    row = json.loads(encode_completions([record()]))
    assert row["prompt_ids"] == "BwAAAAgAAAAJAAAACgAAAA=="
    assert row["served_turns"][0]["completion_ids"] == "AwAAAP//AwA="


@pytest.mark.parametrize("stdlib", [False, True], ids=["orjson", "stdlib"])
def test_records_round_trip(stdlib):
    records = [record(), record(id="s2", prompt_ids=[], completion_ids=[], earlier_turns=(), quality=None,
                                served_turns=(), thinking=False)]
    with jsoncodec.standard_library() if stdlib else nullcontext():
        assert decode_completions(encode_completions(records), what="c") == records


def test_shards_with_ids_as_lists_read_the_same():
    listed = encode_completions([record()], ids_as_lists=True)
    row = json.loads(listed)
    assert row["prompt_ids"] == [7, 8, 9, 10] and row["served_turns"][0]["prompt_ids"] == [1, 2]
    assert decode_completions(listed, what="c") == [record()]
    # As a version that wrote lists wrote it, key for key.
    old = (b'{"id":"s3","prompt_ids":[5,6],"completion_ids":[7],"finish_reason":"length","thinking":false,'
           b'"text":"t","source":"a.jsonl:1"}\n')
    assert decode_completions(old, what="c") == [
        CompletionRecord("s3", [5, 6], [7], "length", False, "t", "a.jsonl:1")
    ]


def test_ids_outside_uint32_are_refused_when_written():
    for bad in ([-1], [2**32]):
        with pytest.raises(OverflowError):
            encode_completions([record(completion_ids=bad)])


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ('"AQAAAAIAAA"', "completion_ids: token ids are not base64: Incorrect padding"),
        ('"AQAAAAIA"', "completion_ids: token ids are 6 bytes of base64, not a whole number of uint32"),
        ('"AQ*AAAIAAAA="', "completion_ids: token ids are not base64: Only base64 data is allowed"),
        ('"AQAAAAIAAAA=\\n"', "completion_ids: token ids are not base64: Excess data after padding"),
        ('[1, "x"]', "invalid literal for int"),
    ],
)
def test_bad_ids_name_the_file_line_record_and_key(value, reason):
    good = encode_completions([record()])
    bad = f'{{"id":"s9","prompt_ids":[1],"completion_ids":{value},"finish_reason":"stop","thinking":true}}\n'
    with pytest.raises(ShardFormatError, match=r"^c\.jsonl:2: completion record s9: ") as caught:
        decode_completions(good + bad.encode(), what="c.jsonl")
    assert reason in str(caught.value)


def test_a_line_that_is_not_an_object_is_a_format_error():
    with pytest.raises(ShardFormatError, match=r"^c:1: completion record \?: "):
        decode_completions(b"[1, 2]\n", what="c")



# Base64 text as a damaged shard could hold it: the alphabet, padding in any place, whitespace, other characters.
_DAMAGED = st.text(alphabet=st.sampled_from("AQIg+/9z=\n -_*é"), max_size=24)
_WELL_FORMED = st.binary(max_size=24).map(lambda b: binascii.b2a_base64(b, newline=False).decode())


def _strict_reference(text: str) -> list[int] | str:
    """The ids as the standard library's strict base64 and little-endian uint32 give them, or why not."""
    try:
        raw = binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError) as exc:
        return str(exc)
    if len(raw) % 4:
        return "not a whole number of uint32"
    return [int.from_bytes(raw[i : i + 4], "little") for i in range(0, len(raw), 4)]


@settings(max_examples=400, deadline=None)
@given(st.one_of(_DAMAGED, _WELL_FORMED))
def test_ids_read_exactly_what_strict_base64_reads_and_refuse_the_rest_with_its_reason(text):
    expected = _strict_reference(text)
    if isinstance(expected, list):
        assert token_ids(text) == expected
    else:
        with pytest.raises(ValueError) as refused:
            token_ids(text)
        assert expected in str(refused.value)
