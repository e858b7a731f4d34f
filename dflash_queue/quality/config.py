"""The `[quality]` section: the quality gate's checks and what each one does."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from dflash_queue.config.sections import PositiveInt, Section

GateAction = Literal["off", "flag", "drop", "retry"]


class QualityConfig(Section):
    """The quality gate run on every generated turn before a shard is chained to extraction.

    Each check has an action: "off" (not checked), "flag" (kept, flagged in the completion record and the
    training shard metadata), "drop" (left out of the training shard, recorded in the completions shard with
    the decision), "retry" (generated once more with `retry_max_tokens`; if it fails again,
    `on_retry_failure` decides).
    """

    on_empty: GateAction = "drop"
    """Empty: no answer and no reasoning tokens at all."""
    on_stub: GateAction = "flag"
    """Stub: a placeholder answer (the tokens after the thinking block closes): none at all, no letter or digit,
    or stock filler only ("OK.", "Sure.", "N/A", "TODO", "..."). A short answer ("Paris.", a label) is no stub."""
    on_short: GateAction = "off"
    """Short: fewer than `min_answer_tokens` answer tokens. Off by default: a short answer can be the right one."""
    min_answer_tokens: Annotated[int, Field(ge=1)] = 8
    """Answer tokens below which `on_short` applies."""
    on_truncated: GateAction = "flag"
    """Truncated: the engine stopped at the token budget (finish_reason "length")."""
    on_unclosed_thinking: GateAction = "retry"
    """A thinking block that is opened and never closed: there is no answer."""
    on_repetition: GateAction = "drop"
    """A degenerate loop: the completion ends in `repetition_min_repeats` or more back-to-back copies of a unit of
    at most `repetition_max_period` tokens, spanning at least `repetition_min_tokens` tokens."""
    repetition_max_period: PositiveInt = 256
    """Longest repeated unit, in tokens, the loop check looks for."""
    repetition_min_repeats: Annotated[int, Field(ge=2)] = 4
    """Back-to-back copies of the unit that make a loop."""
    repetition_min_tokens: PositiveInt = 32
    """Tokens the repeated copies must span together."""
    on_retry_failure: Literal["flag", "drop"] = "flag"
    """What a retried turn that fails again gets: "flag" (kept) or "drop"."""
    retry_max_tokens: Annotated[int, Field(ge=0)] = 0
    """Token budget of a retry; 0: twice generate.sampling.max_tokens."""
