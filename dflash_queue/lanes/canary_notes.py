"""The run's canary counters in words, as `run`'s summary and `status` print them: kept apart from the canary itself
(canaries.py), which needs torch, so that `status` does not import it."""

from __future__ import annotations


def canary_notes(untestable: int, window: int) -> str:
    """What the canary could not check, and how often it checked past the model's window."""
    notes = ""
    if untestable:
        notes += f"; {untestable:,} shard(s) untestable (no sample followed another in its pass)"
    if window:
        notes += f"; {window:,} past the window"
    return notes


def canary_summary(samples: int, worst_error: float | None, untestable: int, window: int) -> str | None:
    """"N samples rerun alone, worst relative error E" and what it leaves unsaid; None before any was checked."""
    if not samples or worst_error is None:
        return None
    return f"{samples:,} samples rerun alone, worst relative error {worst_error:.2e}" + canary_notes(untestable, window)
