"""Record schemas and what gets regenerated."""

from __future__ import annotations

import json

import pytest

from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import SLOT, Message, Sample
from dflash_queue.data.schemas import RecordError, parse_record
from dflash_queue.data.selection import to_sample


def conversation(record: dict):
    return parse_record(record)


def test_sharegpt_roles_are_normalised_and_tool_turns_kept():
    record = {
        "system": "Use tools when needed.",
        "conversations": [
            {"from": "human", "value": "Weather in Oslo?"},
            {"from": "gpt", "value": "Let me look it up."},
            {"from": "tool", "value": '{"temp": -3}'},
            {"from": "GPT", "value": "It is -3 °C."},
        ],
    }
    parsed = conversation(record)
    assert [m.role for m in parsed.messages] == ["system", "user", "assistant", "tool", "assistant"]
    sample = to_sample(parsed, source="f:1")
    assert [m.role for m in sample.messages] == ["system", "user", "assistant", "tool"]
    assert sample.reference == "It is -3 °C."


def test_openai_reasoning_content_tool_calls_and_content_parts():
    calls = [{"type": "function", "function": {"name": "lookup", "arguments": {"city": "Oslo"}}}]
    record = {
        "messages": [
            {"role": "developer", "content": "Be exact."},
            {"role": "user", "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Oslo?"}]},
            {"role": "assistant", "content": None, "tool_calls": calls, "reasoning_content": "Need data."},
            {"role": "tool", "content": '{"temp": -3}'},
            {"role": "assistant", "content": "It is -3 °C.", "reasoning_content": "Read the tool result."},
        ]
    }
    sample = to_sample(conversation(record), source="f:1")
    system, user, call, tool = sample.messages
    assert system == Message("system", "Be exact.")
    assert user.content == "Weather\nin Oslo?"
    assert call.reasoning == "Need data." and json.loads(call.tool_calls) == calls and call.content == ""
    assert call.to_json()["tool_calls"] == calls and call.to_json()["reasoning_content"] == "Need data."
    assert tool.role == "tool"
    # The id covers the tool call: the same conversation with another call is another sample.
    other = json.loads(json.dumps(record))
    other["messages"][2]["tool_calls"][0]["function"]["arguments"] = {"city": "Bergen"}
    assert to_sample(conversation(other), source="f:2").id != sample.id


def test_plain_prompt_records():
    sample = to_sample(conversation({"prompt": "Say hi.", "system": "Be warm.", "response": "OK."}), source="f:1")
    assert sample.messages == (Message("system", "Be warm."), Message("user", "Say hi."))
    assert sample.reference == "OK."


@pytest.mark.parametrize(
    "record, reason, key",
    [
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
         "unsupported content part: 'image_url'", "messages[0].content[0]"),
        ({"messages": [{"role": "user", "content": "\ud800 lone"}]}, "invalid Unicode: lone surrogate in text",
         "messages[0].content"),
        ({"messages": [{"role": "user", "content": "  "}]}, "empty content", "messages[0].content"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", "tool_calls": "no"}]},
         "wrong type: tool_calls must be a list of objects", "messages[1].tool_calls"),
        ({"prompt": 12}, "wrong type: content must be a string, got int", "prompt"),
        ({"conversations": {"from": "human"}}, "wrong type: expected a list, got dict", "conversations"),
        ({"conversations": [{"from": None, "value": "x"}]}, "missing or non-string role: None", "conversations[0].from"),
    ],
)
def test_bad_records_name_reason_and_key(record, reason, key):
    with pytest.raises(RecordError) as info:
        to_sample(conversation(record), source="f:1")
    assert (info.value.reason, info.value.key) == (reason, key)


def test_regenerate_all_turns_makes_slots_in_order():
    record = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Hi"},
            {"from": "gpt", "value": "Hello!"},
            {"from": "human", "value": "2+2?"},
            {"from": "gpt", "value": "4"},
            {"from": "human", "value": "And 3+3?"},
        ]
    }
    sample = to_sample(conversation(record), source="f:1", regenerate="all")
    assert sample.messages == (
        Message("system", "Be brief."), Message("user", "Hi"), SLOT, Message("user", "2+2?"), SLOT,
        Message("user", "And 3+3?"), SLOT,
    )
    assert sample.num_turns == 3 and sample.regenerate == "all"
    # The dataset's replies do not matter to what gets generated: same skeleton, same id.
    record["conversations"][2]["value"] = "Hey."
    assert to_sample(conversation(record), source="f:2", regenerate="all").id == sample.id
    # The prompt shard keeps the mode.
    assert Sample.from_json(json.loads(json.dumps(sample.to_json()))) == sample


def test_regenerate_all_rejects_an_assistant_turn_that_answers_nobody():
    record = {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                           {"role": "assistant", "content": "c"}]}
    with pytest.raises(RecordError) as info:
        to_sample(conversation(record), source="f:1", regenerate="all")
    assert info.value.key == "messages[2]" and "follows assistant" in info.value.reason


def test_regenerate_last_rejects_an_empty_context_reply_but_not_an_empty_final_one(tmp_path):
    rows = [
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""},
                      {"role": "user", "content": "b"}]},
        {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": ""}]},
    ]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows))
    items = list(read_dataset([path], max_record_bytes=1 << 20))
    assert items[0].reason == "empty content" and items[0].key == "messages[1].content"
    assert isinstance(items[1], Sample) and items[1].reference == ""


WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


def test_tools_are_read_from_openai_and_sharegpt_records():
    openai = parse_record({"messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER_TOOL]})
    assert json.loads(openai.tools) == [WEATHER_TOOL]
    as_text = parse_record({"conversations": [{"from": "human", "value": "hi"}], "tools": json.dumps([WEATHER_TOOL])})
    assert as_text.tools == openai.tools
    assert parse_record({"messages": [{"role": "user", "content": "hi"}]}).tools is None


def test_sharegpt_function_calls_become_assistant_tool_calls():
    record = {
        "conversations": [
            {"from": "human", "value": "weather in Oslo?"},
            {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Oslo"}})},
            {"from": "observation", "value": "{\"c\": 3}"},
            {"from": "gpt", "value": "3 degrees."},
        ]
    }
    call = parse_record(record).messages[1]
    assert (call.role, call.content) == ("assistant", "")
    assert json.loads(call.tool_calls) == [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    ]


@pytest.mark.parametrize(
    ("record", "reason", "key"),
    [
        ({"messages": [{"role": "user", "content": "x"}], "tools": {"name": "f"}}, "tools must be a list", "tools"),
        ({"messages": [{"role": "user", "content": "x"}], "tools": "[1, 2]"}, "tools must be a list", "tools"),
        ({"conversations": [{"from": "human", "value": "x"}, {"from": "function_call", "value": "{\"args\": 1}"}]},
         "a function_call must be a JSON object with a \"name\"", "conversations[1].value"),
    ],
)
def test_bad_tools_name_reason_and_key(record, reason, key):
    with pytest.raises(RecordError) as raised:
        parse_record(record)
    assert reason in raised.value.reason and raised.value.key == key


def test_tool_calls_stay_verbatim_and_only_answers_are_regenerated():
    messages = [
        {"role": "user", "content": "weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "w"}}]},
        {"role": "tool", "content": "3 C"},
        {"role": "assistant", "content": "3 degrees."},
        {"role": "user", "content": "thanks"},
        {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "log"}}]},
    ]
    conversation = parse_record({"messages": messages, "tools": [WEATHER_TOOL]})
    every = to_sample(conversation, source="f:1", regenerate="all")
    assert [(m.role, m.is_slot, m.tool_calls is not None) for m in every.messages] == [
        ("user", False, False), ("assistant", False, True), ("tool", False, False), ("assistant", True, False),
        ("user", False, False), ("assistant", True, False),  # a closing tool call is regenerated
    ]
    assert every.tools == conversation.tools and every.num_turns == 2
    last = to_sample(conversation, source="f:1", regenerate="last")
    assert last.messages[1].tool_calls is not None and last.messages[-1].role == "user"
    without_tools = to_sample(parse_record({"messages": messages}), source="f:1", regenerate="all")
    assert without_tools.id != every.id  # the tools are part of what is regenerated from
    assert Sample.from_json(json.loads(json.dumps(every.to_json()))) == every
