"""Prompt and completion shards as JSON lines: round trips through either codec, line numbers in errors."""

from __future__ import annotations

from contextlib import nullcontext

import pytest

from dflash_queue import jsoncodec
from dflash_queue.data.samples import Message, Sample, sample_id
from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.completions import (
    CompletionRecord,
    ServedTurn,
    TurnSpan,
    decode_completions,
    encode_completions,
    token_ids,
)
from dflash_queue.shards.jsonl import dump_jsonl, load_jsonl, load_numbered_jsonl
from dflash_queue.shards.prompts import decode_prompts, encode_prompts
from dflash_queue.shards.verdicts import Verdict

# Characters str.splitlines() breaks on that JSON leaves unescaped, with other non-ASCII text.
AWKWARD = "line\u2028separator\u2029paragraph\x85next «naïve» 数据 🙂 \"quoted\" \\ tab\t"


def samples() -> list[Sample]:
    tools = '[{"function":{"name":"f","parameters":{"x":1e-05}},"type":"function"}]'
    messages = (Message("system", AWKWARD), Message("user", "2+2?"))
    calls = (Message("user", "call f"), Message("assistant", "", "why: " + AWKWARD, '[{"function":{"name":"f"}}]'),
             Message("tool", "4"), Message("assistant", ""))
    return [
        Sample(sample_id(messages), messages, "d.jsonl:1", thinking=False),
        Sample(sample_id(calls, tools), calls, "d.jsonl:2", regenerate="all", tools=tools),
    ]


def records() -> list[CompletionRecord]:
    return [
        CompletionRecord("a" * 32, [1, 2, 3, 4], [5, 6], "stop", True, AWKWARD, "d.jsonl:1", (TurnSpan(1, 3, "stop"),),
                         Verdict("keep", ("loop",), (), 2, "closed"), (ServedTurn([1], [9, 10], "length"),)),
        CompletionRecord("b" * 32, [], [], "length", False, "", "d.jsonl:2"),
    ]


@pytest.mark.parametrize("stdlib", [False, True], ids=["orjson", "stdlib"])
def test_shards_round_trip_text_that_splitlines_would_break(stdlib):
    with jsoncodec.standard_library() if stdlib else nullcontext():
        prompts = encode_prompts(samples())
        completions = encode_completions(records())
        assert prompts.count(b"\n") == 2 and completions.count(b"\n") == 2
        assert decode_prompts(prompts, what="p") == samples()
        assert decode_completions(completions, what="c") == records()


def test_both_codecs_read_what_either_wrote():
    fast_prompts, fast_completions = encode_prompts(samples()), encode_completions(records())
    with jsoncodec.standard_library():
        slow_prompts, slow_completions = encode_prompts(samples()), encode_completions(records())
        assert decode_prompts(fast_prompts, what="p") == samples()
        assert decode_completions(fast_completions, what="c") == records()
    assert decode_prompts(slow_prompts, what="p") == samples()
    assert decode_completions(slow_completions, what="c") == records()
    # Only the spelling of floats differs between the two (the tool schema's 1e-05).
    assert fast_completions == slow_completions
    assert fast_prompts.replace(b"0.00001", b"1e-05") == slow_prompts


@pytest.mark.parametrize("stdlib", [False, True], ids=["orjson", "stdlib"])
def test_a_corrupt_line_is_named_by_its_number(stdlib):
    with jsoncodec.standard_library() if stdlib else nullcontext():
        good = dump_jsonl([{"id": "x"}])
        assert load_jsonl(good + b"\n  \n" + good, what="w") == [{"id": "x"}, {"id": "x"}]
        with pytest.raises(ShardFormatError, match=r"^w:3: corrupt JSON line: Expecting ',' delimiter$"):
            load_jsonl(good + good + b'{"id": "x" "y"}\n', what="w")
        with pytest.raises(ShardFormatError, match=r"^w:2: corrupt JSON line: invalid UTF-8 at byte 8$"):
            load_jsonl(good + b'{"id": "\xff"}\n', what="w")


def test_token_ids_convert_exactly_as_int_did():
    ids = [5, 150_000, 0]
    assert token_ids(ids) is ids
    for values in ([1.0, 2], ["3", 4], [True, False, 7], (1, 2), range(3), [2**70]):
        converted = token_ids(values)
        assert converted == [int(v) for v in values] and all(type(v) is int for v in converted)
    for bad in ([1.5, "x"], [None], [[1]]):
        with pytest.raises((TypeError, ValueError)):
            token_ids(bad)


@pytest.mark.parametrize("stdlib", [False, True], ids=["orjson", "stdlib"])
def test_blank_lines_are_skipped_and_counted(stdlib):
    with jsoncodec.standard_library() if stdlib else nullcontext():
        data = b'{"a": 1}\n\n \t\r\n\x0b\n  {"a": 2}\r\n\t{"a": 3}'
        assert [(n, row["a"]) for n, row in load_numbered_jsonl(data, what="w")] == [(1, 1), (5, 2), (6, 3)]
        with pytest.raises(ShardFormatError, match=r"^w:4: corrupt JSON line"):
            load_numbered_jsonl(b'{"a": 1}\n\n \n x\n', what="w")
        assert load_numbered_jsonl(b"", what="w") == [] and load_numbered_jsonl(b"\n\n", what="w") == []
