"""The quality gate's verdict on a sample as completion records and training shards store it.

The gate (dflash_queue.quality.gate) decides; this is only the record of its decision, so that the formats
read and write it without knowing the policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KEEP, FLAG, DROP = "keep", "flag", "drop"
DECISIONS = (KEEP, FLAG, DROP)


@dataclass(frozen=True)
class Verdict:
    """The gate's word on one sample (all its generated turns), stored with the completion record."""

    decision: str = KEEP
    # Checks failed by the final attempt of any turn.
    flags: tuple[str, ...] = ()
    # Checks that sent a turn back for a retry.
    retried: tuple[str, ...] = ()
    # Fewest answer tokens of any turn.
    answer_tokens: int = 0
    # Thinking state of the last turn ("closed", "off", "unclosed", "none").
    thinking: str = "none"

    @property
    def kept(self) -> bool:
        return self.decision != DROP

    def to_json(self) -> dict[str, Any]:
        return {
            "decision": self.decision,
            "flags": list(self.flags),
            "retried": list(self.retried),
            "answer_tokens": self.answer_tokens,
            "thinking": self.thinking,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Verdict:
        return cls(
            decision=str(data.get("decision", KEEP)),
            flags=tuple(data.get("flags", ())),
            retried=tuple(data.get("retried", ())),
            answer_tokens=int(data.get("answer_tokens", 0)),
            thinking=str(data.get("thinking", "none")),
        )


def quality_entry(verdict: Verdict | None) -> dict[str, Any]:
    """The verdict as a training shard stores it per sample (`quality` metadata); a sample without one passed
    nothing."""
    verdict = verdict or Verdict()
    return {"flags": list(verdict.flags), "answer_tokens": verdict.answer_tokens, "thinking": verdict.thinking}
