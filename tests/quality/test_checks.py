"""The gate's checks on real token ids from the tiny model's tokenizer and chat template."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from dflash_queue.data.chat_template import ChatFormatter
from dflash_queue.data.samples import Message
from dflash_queue.quality.checks import LoopRule, TokenMarkers, assess_turn, loop_period
from dflash_queue.quality.config import QualityConfig
from dflash_queue.quality.gate import DROP, FLAG, KEEP, RETRY, GateCounts, QualityGate, Verdict, gate_summary

QUESTION = (Message("user", "What is 2 + 2?"),)


@pytest.fixture(scope="module")
def kit(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    return tokenizer, ChatFormatter(tokenizer), TokenMarkers.from_tokenizer(tokenizer)


def turn(kit, completion_text: str, *, thinking: bool, prompt_opening: str = ""):
    """(turn ids, completion start) as the lane sees them: generation prompt, then the generated ids."""
    tokenizer, formatter, _ = kit
    opening = formatter.generation_prompt_ids(enable_thinking=thinking) + formatter.encode(prompt_opening)
    completion = formatter.encode(completion_text)
    return opening + completion, len(opening)


def assess(kit, text: str, *, thinking: bool, finish: str = "stop", opening: str = ""):
    ids, start = turn(kit, text, thinking=thinking, prompt_opening=opening)
    return assess_turn(ids, start, finish, kit[2], LoopRule())


def test_thinking_closed_in_the_completion_counts_only_the_answer(kit):
    a = assess(kit, "<think>\nadd them\n</think>\n\nThe answer is four, so 2 + 2 = 4.<|im_end|>", thinking=True)
    assert a.thinking == "closed" and not a.truncated and a.loop_period == 0
    tokenizer = kit[0]
    expected = len([t for t in tokenizer("The answer is four, so 2 + 2 = 4.", add_special_tokens=False)["input_ids"]
                    if tokenizer.decode([t]).strip()])
    assert a.answer_tokens == expected
    assert a.failed(min_answer_tokens=expected) == ()
    assert a.failed(min_answer_tokens=expected + 1) == ("short",)  # short, not a stub: it answers


def test_thinking_off_the_template_closed_block_is_in_the_prompt(kit):
    a = assess(kit, "Four.<|im_end|>", thinking=False)
    assert a.thinking == "off" and a.answer_tokens == len(kit[1].encode("Four.")) == a.completion_tokens - 1
    assert a.failed(min_answer_tokens=8) == ("short",)


@pytest.mark.parametrize(
    ("completion", "thinking", "failed"),
    [
        # Short correct answers: not stubs (only "short", which the gate leaves off by default).
        ("The capital of France is Paris.<|im_end|>", False, ("short",)),
        ("Paris<|im_end|>", False, ("short",)),
        ("positive<|im_end|>", False, ("short",)),
        ("Yes.<|im_end|>", False, ("short",)),
        ("<think>\nThe sentiment is upbeat.\n</think>\n\nPositive<|im_end|>", True, ("short",)),
        # Placeholders: stock filler, punctuation only, or nothing after the thinking.
        ("OK.<|im_end|>", False, ("stub",)),
        ("Sure!<|im_end|>", False, ("stub",)),
        ("N/A<|im_end|>", False, ("stub",)),
        ("...<|im_end|>", False, ("stub",)),
        ("<think>\nLet me work this out carefully.\n</think>\n\n<|im_end|>", True, ("stub",)),
        ("<think>\nI will answer.\n</think>\n\nOkay<|im_end|>", True, ("stub",)),
        # Long enough and real: nothing.
        ("Two plus two is four, because adding two units to two units gives four units.<|im_end|>", False, ()),
    ],
)
def test_stubs_are_placeholders_and_short_answers_are_not(kit, completion, thinking, failed):
    # 16: "The capital of France is Paris." is 13 tokens here (7 with a real Qwen tokenizer).
    assert assess(kit, completion, thinking=thinking).failed(min_answer_tokens=16) == failed


def test_short_answers_pass_the_default_gate_and_stubs_are_flagged(kit):
    gate = QualityGate(QualityConfig(), kit[2])
    for text, decision in (("Paris.<|im_end|>", KEEP), ("positive<|im_end|>", KEEP), ("OK.<|im_end|>", FLAG)):
        ids, start = turn(kit, text, thinking=False)
        assert gate.judge(ids, start, "stop").decision == decision, text


def test_template_that_opens_thinking_in_the_prompt(kit):
    closed = assess(kit, "adding\n</think>\n\nIt is 4, clearly and simply.<|im_end|>", thinking=True, opening="<think>\n")
    assert closed.thinking == "closed" and closed.answer_tokens > 5
    # The completion alone shows no <think> at all: judged on the turn, the block never closed.
    unclosed = assess(kit, "adding two and two and", thinking=True, opening="<think>\n", finish="length")
    assert unclosed.thinking == "unclosed" and unclosed.answer_tokens == 0
    assert unclosed.failed(min_answer_tokens=8) == ("truncated", "unclosed_thinking")


def test_empty_completion_and_empty_thinking(kit):
    assert assess(kit, "<|im_end|>", thinking=False).failed(min_answer_tokens=8) == ("empty",)
    assert assess(kit, "<think>\n\n</think>\n\n<|im_end|>", thinking=True).failed(min_answer_tokens=8) == ("empty",)


def test_loops_are_found_at_the_tail_only():
    rule = LoopRule(max_period=16, min_repeats=4, min_tokens=20)
    assert loop_period([9, 8] + [1, 2, 3, 4, 5] * 5, rule) == 5
    assert loop_period([7] * 25, rule) == 1
    assert loop_period([1, 2, 3, 4, 5] * 5 + [6, 7, 8], rule) == 0  # recovered: not a degenerate ending
    assert loop_period([1, 2, 3] * 3, rule) == 0  # too short to call
    assert loop_period(list(range(100)), rule) == 0


def test_repetition_detected_in_a_real_turn(kit):
    # A model in a loop emits the same ids again and again (the cut at the budget may fall mid-unit).
    opening = kit[1].generation_prompt_ids(enable_thinking=False)
    unit = kit[1].encode(" The cat sat on the mat.")
    ids = opening + kit[1].encode("Sure.") + unit * 12 + unit[:3]
    a = assess_turn(ids, len(opening), "length", kit[2], LoopRule())
    assert a.loop_period == len(unit)
    assert a.failed(min_answer_tokens=8) == ("truncated", "repetition")


def gate(kit, **policy) -> QualityGate:
    return QualityGate(QualityConfig(**policy), kit[2])


def test_policy_strongest_action_wins_and_retry_falls_back(kit):
    g = gate(kit, on_stub="flag", on_truncated="retry", on_repetition="drop", on_retry_failure="drop")
    assert g.decide([], after_retry=False) == KEEP
    assert g.decide(["stub"], after_retry=False) == FLAG
    assert g.decide(["stub", "truncated"], after_retry=False) == RETRY
    assert g.decide(["truncated", "repetition"], after_retry=False) == DROP
    assert g.decide(["stub", "truncated"], after_retry=True) == DROP
    off = gate(kit, on_stub="off")
    ids, start = turn(kit, "Four.<|im_end|>", thinking=False)
    assert off.judge(ids, start, "stop").failed == () and off.judge(ids, start, "stop").decision == KEEP


def test_counts_and_summary_lines():
    counts = GateCounts()
    counts.add(Verdict(KEEP))
    counts.add(Verdict(FLAG, flags=("stub", "truncated"), retried=("truncated",)))
    counts.add(Verdict(DROP, flags=("empty",)))
    assert counts.as_dict() == {
        "gate_keep": 1, "gate_flag": 1, "gate_drop": 1, "gate_retried": 1, "gate_truncated_retry": 1,
        "gate_stub_flag": 1, "gate_truncated_flag": 1, "gate_empty_drop": 1,
    }
    assert gate_summary(counts.as_dict()) == [
        "1 kept, 1 flagged, 1 dropped, 1 retried",
        "empty: 1 dropped",
        "stub: 1 flagged",
        "truncated: 1 flagged, 1 retried",
    ]
