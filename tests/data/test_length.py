"""The length filter with the real tokenizer and chat template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from dflash_queue.data.chat_template import ChatFormatter
from dflash_queue.data.length import Counted, LengthFilter, source_position
from dflash_queue.data.problems import BadRecord
from dflash_queue.data.samples import SLOT, Message, Sample, sample_id


def make(text: str, *, thinking: bool = True, source: str = "d.jsonl:1", all_turns: bool = False) -> Sample:
    messages = (Message("user", text), SLOT) if all_turns else (Message("user", text),)
    return Sample(sample_id(messages), messages, source, thinking=thinking, regenerate="all" if all_turns else "last")


@pytest.fixture(scope="module")
def formatter(tiny_model) -> ChatFormatter:
    return ChatFormatter(AutoTokenizer.from_pretrained(tiny_model))


def test_counts_are_the_templated_prompt_ids(formatter):
    samples = [make("short"), make("a much longer question " * 30, thinking=False), make("all", all_turns=True)]
    counted = LengthFilter(formatter, max_model_len=4096, budget=16).count(samples)
    assert counted[0] == len(formatter.prompt_ids(samples[0].messages, enable_thinking=True))
    assert counted[1] == len(formatter.prompt_ids(samples[1].messages, enable_thinking=False))
    assert counted[2] == len(formatter.prompt_ids(samples[2].messages[:1], enable_thinking=True))
    assert counted[1] > 4 * counted[0]


def test_prompts_that_leave_too_little_room_are_skipped_with_a_reason(formatter):
    short, long = make("hi", source="a.jsonl:3"), make("word " * 400, source="b.parquet#7")
    tokens = len(formatter.prompt_ids(long.messages, enable_thinking=True))
    limit = LengthFilter(formatter, max_model_len=tokens + 99, budget=100)
    out = [limit.judge(s, t) for s, t in zip([short, long, short], limit.count([short, long, short]))]
    assert [type(o).__name__ for o in out] == ["Counted", "BadRecord", "Counted"]
    bad: BadRecord = out[1]
    assert (bad.file, bad.line, bad.unit) == ("b.parquet", 7, "row")
    assert bad.reason == f"prompt too long: {tokens} tokens leave 99 < 100 for generation inside max_model_len {tokens + 99}"
    roomier = LengthFilter(formatter, max_model_len=tokens + 100, budget=100)
    assert roomier.judge(long, tokens) == Counted(long, tokens)


def test_source_positions():
    assert source_position("/x/d.jsonl:12") == ("/x/d.jsonl", 12, "line")
    assert source_position("/x/d.parquet#0") == ("/x/d.parquet", 0, "row")
    assert source_position("weird") == ("weird", 0, "line")


def test_conversations_the_template_refuses_are_bad_records_and_the_rest_is_counted(tiny_model_with_template):
    from dfq_testing.templates import ALTERNATING_TEMPLATE

    formatter = ChatFormatter(AutoTokenizer.from_pretrained(tiny_model_with_template(ALTERNATING_TEMPLATE)))
    fine = [make("first", source="d.jsonl:1"), make("second", thinking=False, source="d.jsonl:4")]
    twice = (Message("user", "one"), Message("user", "two"))
    refused = Sample(sample_id(twice), twice, "d.jsonl:2")
    limit = LengthFilter(formatter, max_model_len=4096, budget=16)
    batch = [fine[0], refused, fine[1]]
    out = [limit.judge(s, t) for s, t in zip(batch, limit.count(batch))]
    assert [type(o).__name__ for o in out] == ["Counted", "BadRecord", "Counted"]
    assert [o.prompt_tokens for o in (out[0], out[2])] == [
        len(formatter.prompt_ids(s.messages, enable_thinking=s.thinking)) for s in fine
    ]
    assert str(out[1]) == ("d.jsonl:2: chat template refused the conversation: Conversation roles must alternate "
                           "user/assistant/user/assistant/...")
