"""What the run's canary counters leave unsaid, as `run`'s summary and `status` print it: kept apart from the
canary itself (canaries.py), which needs torch, so that `status` does not import it."""

from __future__ import annotations


def canary_notes(untestable: int, window: int) -> str:
    """What the canary could not check, and how often it checked past the model's window."""
    notes = ""
    if untestable:
        notes += f"; {untestable:,} shard(s) untestable (no sample followed another in its pass)"
    if window:
        notes += f"; {window:,} past the window"
    return notes
