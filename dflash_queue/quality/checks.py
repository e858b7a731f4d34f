"""Measurements of one generated assistant turn, on token ids.

A turn is judged on the full sequence of the turn (the generation prompt the template wrote, then the
generated ids), not on the completion text: with thinking off the prompt already holds an empty
`<think>\n\n</think>` block, and some templates open `<think>` in the prompt so that the completion holds only
the closing tag. Answer tokens are the content tokens after the thinking block closes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from dflash_queue.quality.placeholders import is_placeholder

THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"
# Placeholder answers are short: longer answers are not decoded to look for one.
PLACEHOLDER_MAX_TOKENS = 16


@dataclass
class TokenMarkers:
    """What the checks need to know about a tokenizer's ids."""

    think_open: int | None
    think_close: int | None
    # Special tokens (end of turn, padding): never content.
    special: frozenset[int]
    # Token ids -> text, to tell whitespace-only tokens apart (cached per id).
    decode: Callable[[list[int]], str] | None = None
    _blank: dict[int, bool] = field(default_factory=dict)

    @classmethod
    def from_tokenizer(cls, tokenizer) -> TokenMarkers:
        vocab = tokenizer.get_vocab()
        special = set(tokenizer.all_special_ids)
        return cls(
            think_open=vocab.get(THINK_OPEN),
            think_close=vocab.get(THINK_CLOSE),
            special=frozenset(special),
            decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=False),
        )

    def is_content(self, token: int) -> bool:
        """Not special, not a thinking tag, not whitespace only."""
        if token in self.special or token == self.think_open or token == self.think_close:
            return False
        blank = self._blank.get(token)
        if blank is None:
            blank = self._blank[token] = self.decode is not None and not self.decode([token]).strip()
        return not blank


@dataclass(frozen=True)
class TurnAssessment:
    completion_tokens: int
    content_tokens: int
    answer_tokens: int
    # "closed": the turn's thinking block closed in the generated ids; "off": the template closed an empty block
    # in the prompt (thinking disabled); "unclosed": opened, never closed; "none": no thinking block at all.
    thinking: str
    truncated: bool
    # Period (tokens) of the loop the completion ends in; 0 when there is none.
    loop_period: int
    # The answer holds no answer: nothing after the thinking block, no letter or digit, or stock filler ("OK.").
    placeholder: bool = False

    def failed(self, *, min_answer_tokens: int) -> tuple[str, ...]:
        """Names of the checks this turn fails, in the order of `CHECKS`."""
        out = []
        if self.content_tokens == 0:
            out.append("empty")
        elif self.thinking != "unclosed" and self.placeholder:
            out.append("stub")
        elif self.thinking != "unclosed" and self.answer_tokens < min_answer_tokens:
            out.append("short")
        if self.truncated:
            out.append("truncated")
        if self.thinking == "unclosed":
            out.append("unclosed_thinking")
        if self.loop_period:
            out.append("repetition")
        return tuple(out)


CHECKS = ("empty", "stub", "short", "truncated", "unclosed_thinking", "repetition")


@dataclass(frozen=True)
class LoopRule:
    max_period: int = 256
    min_repeats: int = 4
    min_tokens: int = 32


def assess_turn(
    turn_ids: Sequence[int],
    completion_start: int,
    finish_reason: str,
    markers: TokenMarkers,
    loops: LoopRule,
) -> TurnAssessment:
    """Judge one turn: `turn_ids` is the generation prompt followed by the generated ids, which start at
    `completion_start`."""
    completion = turn_ids[completion_start:]
    close_at = _last_index(turn_ids, markers.think_close)
    open_at = _last_index(turn_ids, markers.think_open)
    if open_at > close_at:
        thinking, answer_from = "unclosed", len(turn_ids)
    elif close_at >= completion_start:
        thinking, answer_from = "closed", close_at + 1
    elif close_at >= 0:
        thinking, answer_from = "off", completion_start
    else:
        thinking, answer_from = "none", completion_start
    answer_from = max(answer_from, completion_start)
    answer = [t for t in turn_ids[answer_from:] if markers.is_content(t)]
    placeholder = not answer
    if answer and len(answer) <= PLACEHOLDER_MAX_TOKENS and markers.decode is not None:
        placeholder = is_placeholder(markers.decode([t for t in turn_ids[answer_from:] if t not in markers.special]))
    return TurnAssessment(
        completion_tokens=len(completion),
        content_tokens=sum(1 for t in completion if markers.is_content(t)),
        answer_tokens=len(answer),
        thinking=thinking,
        truncated=finish_reason == "length",
        loop_period=loop_period([t for t in completion if t not in markers.special], loops),
        placeholder=placeholder,
    )


def _last_index(ids: Sequence[int], token: int | None) -> int:
    if token is None:
        return -1
    for index in range(len(ids) - 1, -1, -1):
        if ids[index] == token:
            return index
    return -1


def loop_period(ids: Sequence[int], rule: LoopRule) -> int:
    """The smallest period p such that the ids end in at least `min_repeats` back-to-back copies of a p-token
    unit spanning at least `min_tokens` tokens; 0 when there is none."""
    length = len(ids)
    if length < rule.min_tokens:
        return 0
    for period in range(1, min(rule.max_period, length // rule.min_repeats) + 1):
        # Count trailing positions that equal the position one period earlier.
        run = 0
        index = length - 1
        while index - period >= 0 and ids[index] == ids[index - period]:
            run += 1
            index -= 1
        span = run + period
        if span >= rule.min_tokens and span >= rule.min_repeats * period:
            return period
    return 0
