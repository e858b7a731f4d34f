"""The chat formatter on the tiny model's real tokenizer and Qwen3-style template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from dflash_queue.data.chat_template import ChatFormatter
from dflash_queue.data.samples import Message

CONVERSATIONS = [
    (Message("user", "What is 2 + 2?"),),
    (Message("system", "Be brief."), Message("user", "Hi"), Message("assistant", "Hello!"), Message("user", "Bye")),
    (Message("user", "Weather?"), Message("assistant", "", tool_calls='[{"function":{"name":"w","arguments":{}}}]'),
     Message("tool", '{"t": 3}')),
]


@pytest.fixture(scope="module")
def formatter(tiny_model) -> ChatFormatter:
    return ChatFormatter(AutoTokenizer.from_pretrained(tiny_model))


@pytest.mark.parametrize("thinking", [True, False])
def test_batch_rendering_and_counting_match_one_by_one(formatter, thinking):
    texts = formatter.render_batch(CONVERSATIONS, enable_thinking=thinking)
    assert texts == [formatter.render(c, enable_thinking=thinking) for c in CONVERSATIONS]
    assert formatter.count_tokens(texts) == [len(formatter.prompt_ids(c, enable_thinking=thinking)) for c in CONVERSATIONS]


def test_generation_prompt_is_the_tail_of_every_prompt(formatter):
    for thinking, text in ((True, "<|im_start|>assistant\n"), (False, "<|im_start|>assistant\n<think>\n\n</think>\n\n")):
        opening = formatter.generation_prompt_ids(enable_thinking=thinking)
        assert formatter.tokenizer.decode(opening) == text
        for conversation in CONVERSATIONS:
            assert formatter.prompt_ids(conversation, enable_thinking=thinking)[-len(opening):] == opening


def test_continuation_after_a_generated_turn(formatter):
    tokenizer = formatter.tokenizer
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    follow = [Message("user", "And 3 + 3?")]
    closed = formatter.continuation_ids(follow, enable_thinking=False, last_token=end)
    assert tokenizer.decode(closed) == "\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"
    # A turn cut at the budget did not write its end: the continuation closes it first.
    cut = formatter.continuation_ids(follow, enable_thinking=True, last_token=None)
    assert tokenizer.decode(cut) == "<|im_end|>\n<|im_start|>user\nAnd 3 + 3?<|im_end|>\n<|im_start|>assistant\n"
    # For a reply without reasoning, the template's own rendering of the whole conversation agrees.
    history = (Message("user", "2 + 2?"), Message("assistant", "4"), *follow)
    reply = formatter.encode("4") + [end]
    ours = formatter.prompt_ids(history[:1], enable_thinking=True) + reply + formatter.continuation_ids(
        follow, enable_thinking=True, last_token=end)
    assert ours == formatter.prompt_ids(history, enable_thinking=True)
