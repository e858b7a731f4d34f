"""Numbers for people: counts, bytes, rates and durations in short, stable forms."""

from __future__ import annotations

import math


def count(n: float) -> str:
    """1234 -> "1,234"; 12_345_678 -> "12.3M"; 1.37e9 -> "1.37B"."""
    n = float(n)
    for limit, suffix, digits in ((1e12, "T", 2), (1e9, "B", 2), (1e6, "M", 1)):
        if abs(n) >= limit:
            return f"{n / limit:.{digits}f}{suffix}"
    return f"{n:,.0f}"


def size(n_bytes: float) -> str:
    """Decimal units, as disks are sold: 1.2 GB, 91.2 TB."""
    n = float(n_bytes)
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(n) < 1000 or unit == "PB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def gib(n_bytes: float) -> str:
    """Binary units, as GPU memory is reported: 58.8 GiB; 12.5 MiB below a GiB."""
    if abs(n_bytes) < 1024**3:
        return f"{n_bytes / 1024**2:,.1f} MiB"
    return f"{n_bytes / 1024**3:,.1f} GiB"


def rate(per_s: float, unit: str = "") -> str:
    if per_s == 0:
        return f"0 {unit}/s".strip() if unit else "0/s"
    value = f"{per_s:,.0f}" if per_s >= 100 else f"{per_s:,.1f}" if per_s >= 1 else f"{per_s:.2f}"
    return f"{value} {unit}/s".strip() if unit else f"{value}/s"


def duration(seconds: float | None) -> str:
    """None -> "unknown"; under an hour in minutes, under two days in hours, else days."""
    if seconds is None or math.isnan(seconds):
        return "unknown"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        return f"{seconds / 60:.0f} min"
    if seconds < 48 * 3600:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} days"


def hours(h: float) -> str:
    """GPU-hours: whole hours once they matter, two significant digits below."""
    return f"{h:,.0f}" if h >= 10 else f"{h:.2g}"
