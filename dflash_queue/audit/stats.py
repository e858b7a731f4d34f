"""Distributions as plain JSON-able summaries: count, mean, percentiles and a histogram."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

HISTOGRAM_BINS = 30


def describe(values: Sequence[int | float], *, bins: int = HISTOGRAM_BINS) -> dict[str, Any]:
    if len(values) == 0:
        return {"count": 0}
    array = np.asarray(values, dtype=np.float64)
    low, high = float(array.min()), float(array.max())
    if high == low:
        high = low + 1
    counts, edges = np.histogram(array, bins=bins, range=(low, high))
    p50, p90, p99 = np.percentile(array, [50, 90, 99])
    return {
        "count": int(array.size),
        "mean": round(float(array.mean()), 2),
        "min": _number(array.min()),
        "p50": _number(p50),
        "p90": _number(p90),
        "p99": _number(p99),
        "max": _number(array.max()),
        "histogram": {"edges": [round(float(e), 2) for e in edges], "counts": [int(c) for c in counts]},
    }


def share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def counts_of(values: Sequence[int]) -> dict[str, int]:
    """Exact counts per value (for small discrete values such as turns per conversation)."""
    if not len(values):
        return {}
    unique, counts = np.unique(np.asarray(values, dtype=np.int64), return_counts=True)
    return {str(int(u)): int(c) for u, c in zip(unique, counts)}


def brief(summary: dict[str, Any]) -> str:
    if not summary.get("count"):
        return "none"
    return (
        f"mean {summary['mean']:g}, p50 {summary['p50']:g}, p90 {summary['p90']:g}, p99 {summary['p99']:g}, "
        f"min {summary['min']:g}, max {summary['max']:g}"
    )


def _number(value: Any) -> float | int:
    value = float(value)
    return int(value) if value.is_integer() else round(value, 2)
