from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Message, Sample, sample_id
from dflash_queue.data.thinking import apply_thinking_policy, decide_thinking

REPO = Path(__file__).resolve().parents[2]


def sample(*user_turns: str, system: str | None = None) -> Sample:
    messages = ([Message("system", system)] if system else []) + [Message("user", t) for t in user_turns]
    return Sample(sample_id(tuple(messages)), tuple(messages), "test")


def test_always_and_never_are_unconditional():
    chat = sample("hi!")
    assert apply_thinking_policy(chat, "always").thinking is True
    assert apply_thinking_policy(sample("Prove that sqrt(2) is irrational."), "never").thinking is False
    with pytest.raises(ValueError, match="unknown thinking policy"):
        apply_thinking_policy(chat, "sometimes")


@pytest.mark.parametrize(
    "text, on, rule",
    [
        ("Write a Rust function that parses a date.", True, "code"),
        ("```python\nprint(1)\n```\nwhy does this print 1?", True, "code"),
        ("Solve 3x + 7 = 22 for x.", True, "math"),
        ("A car drives 120 km in 1.5 hours. What is its speed?", True, "math"),
        ("Compare the trade-offs of TCP and UDP step by step.", True, "reasoning"),
        ("Classify the sentiment of: 'great phone'", False, "classification"),
        ("Extract every city name from this paragraph: Paris and Rome are old.", False, "extraction"),
        ("Thanks, that's all!", False, "chit-chat"),
        ("What colour is a flamingo?", False, "short request"),
        ("Tell me about the history of tea. " * 15, True, "long request"),
    ],
)
def test_auto_rules(text, on, rule):
    assert decide_thinking(sample(text)) == (on, rule)


def test_auto_short_follow_up_inherits_the_topic():
    assert decide_thinking(sample("Differentiate x^3 + 2x.", "And the second one?")) == (True, "math")
    assert decide_thinking(sample("Nice.", system="You are a classifier. Reply with one of: A, B.")) == (
        False, "classification")


def test_auto_on_the_example_dataset_follows_its_categories():
    path = REPO / "examples" / "sharegpt_sample.jsonl"
    ids = [json.loads(line)["id"] for line in path.read_text().splitlines()]
    decided = {ids[i]: apply_thinking_policy(s, "auto").thinking
               for i, s in enumerate(read_dataset([path], max_record_bytes=1 << 20))}
    assert all(decided[i] for i in ids if i.startswith(("code-", "math-")))
    assert not any(decided[i] for i in ids if i.startswith(("cls-", "ext-", "chat-")))
