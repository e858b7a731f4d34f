"""Gate decisions: which checks a turn fails, what the configured policy does about it, and the counts.

Per check the policy is "off", "flag", "drop" or "retry". A turn that fails several checks gets the strongest
action (drop > retry > flag). A retried turn that fails again gets `on_retry_failure` instead of "retry".
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field

from dflash_queue.quality.checks import CHECKS, LoopRule, TokenMarkers, TurnAssessment, assess_turn
from dflash_queue.quality.config import QualityConfig
from dflash_queue.shards.verdicts import DECISIONS, DROP, FLAG, KEEP, Verdict

__all__ = ["DECISIONS", "DROP", "FLAG", "KEEP", "RETRY", "GateCounts", "QualityGate", "TurnVerdict", "Verdict",
           "combine_turns", "gate_summary"]

RETRY = "retry"


def combine_turns(turns: Iterable[TurnVerdict]) -> Verdict:
    """One sample's verdict from its turns': the strongest decision, every failed or retried check in the gate's
    order, the fewest answer tokens, the last turn's thinking state."""
    turns = list(turns)
    if not turns:
        return Verdict()
    decisions = {t.decision for t in turns}
    decision = DROP if DROP in decisions else FLAG if FLAG in decisions else KEEP
    flags = {c for t in turns for c in t.failed}
    retried = {c for t in turns for c in t.retried}
    return Verdict(
        decision=decision,
        flags=tuple(c for c in CHECKS if c in flags),
        retried=tuple(c for c in CHECKS if c in retried),
        answer_tokens=min(t.assessment.answer_tokens for t in turns),
        thinking=turns[-1].assessment.thinking,
    )


@dataclass(frozen=True)
class TurnVerdict:
    assessment: TurnAssessment
    failed: tuple[str, ...]
    decision: str  # keep, flag, drop, or retry (before the retry has run)
    retried: tuple[str, ...] = ()


class QualityGate:
    def __init__(self, config: QualityConfig, markers: TokenMarkers) -> None:
        self.config = config
        self.markers = markers
        self.loops = LoopRule(config.repetition_max_period, config.repetition_min_repeats, config.repetition_min_tokens)
        self.policy = {
            "empty": config.on_empty,
            "stub": config.on_stub,
            "short": config.on_short,
            "truncated": config.on_truncated,
            "unclosed_thinking": config.on_unclosed_thinking,
            "repetition": config.on_repetition,
        }

    def judge(
        self, turn_ids: list[int], completion_start: int, finish_reason: str, *, retried: tuple[str, ...] = ()
    ) -> TurnVerdict:
        """Assess one turn and decide. `retried`: the checks that sent this turn back (empty on a first try)."""
        assessment = assess_turn(turn_ids, completion_start, finish_reason, self.markers, self.loops)
        failed = tuple(
            c for c in assessment.failed(min_answer_tokens=self.config.min_answer_tokens) if self.policy[c] != "off"
        )
        return TurnVerdict(assessment, failed, self.decide(failed, after_retry=bool(retried)), retried)

    def decide(self, failed: Iterable[str], *, after_retry: bool) -> str:
        actions = set()
        for check in failed:
            action: str = self.policy[check]
            if action == RETRY and after_retry:
                action = self.config.on_retry_failure
            actions.add(action)
        for action in (DROP, RETRY, FLAG):
            if action in actions:
                return action
        return KEEP


@dataclass
class GateCounts:
    """Decisions of one shard, as ledger counters: `gate_{decision}` per sample, `gate_{check}_{action}` per
    failed check, `gate_retried` per sample that was retried."""

    counts: Counter[str] = field(default_factory=Counter)

    def add(self, verdict: Verdict) -> None:
        self.counts[f"gate_{verdict.decision}"] += 1
        if verdict.retried:
            self.counts["gate_retried"] += 1
        for check in verdict.retried:
            self.counts[f"gate_{check}_retry"] += 1
        if verdict.decision != KEEP:
            for check in verdict.flags:
                self.counts[f"gate_{check}_{verdict.decision}"] += 1

    def as_dict(self) -> dict[str, int]:
        return dict(self.counts)


def gate_summary(counters: dict[str, int]) -> list[str]:
    """Human lines for a run summary from ledger counters."""
    kept, flagged, dropped = (counters.get(f"gate_{d}", 0) for d in DECISIONS)
    retried = counters.get("gate_retried", 0)
    lines = [f"{kept} kept, {flagged} flagged, {dropped} dropped, {retried} retried"]
    for check in CHECKS:
        parts = [
            f"{counters[f'gate_{check}_{action}']} {past}"
            for action, past in ((FLAG, "flagged"), (DROP, "dropped"), (RETRY, "retried"))
            if counters.get(f"gate_{check}_{action}")
        ]
        if parts:
            lines.append(f"{check.replace('_', ' ')}: {', '.join(parts)}")
    return lines
