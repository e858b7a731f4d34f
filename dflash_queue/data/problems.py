"""Bad input records: reported with file, line and key, counted, and skipped."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass(frozen=True)
class BadRecord:
    file: str
    line: int
    reason: str
    key: str = ""
    # "line": 1-based line of a line-oriented file; "row": 0-based index in a JSON array or Parquet file.
    unit: str = "line"

    def __str__(self) -> str:
        where = f"{self.file}:{self.line}" if self.unit == "line" else f"{self.file} row {self.line}"
        if self.key:
            where += f" [{self.key}]"
        return f"{where}: {self.reason}"

    @property
    def kind(self) -> str:
        """The reason without record-specific detail, for counting."""
        return self.reason.split(":", 1)[0]


@dataclass
class ProblemLog:
    """Counts bad records by kind and keeps the first few of each for the report."""

    keep_per_kind: int = 5
    counts: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[BadRecord]] = field(default_factory=dict)

    def add(self, record: BadRecord) -> None:
        self.counts[record.kind] += 1
        kept = self.examples.setdefault(record.kind, [])
        if len(kept) < self.keep_per_kind:
            kept.append(record)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def lines(self) -> list[str]:
        out = []
        for kind, count in self.counts.most_common():
            out.append(f"{count} x {kind}")
            out.extend(f"    {example}" for example in self.examples[kind])
        return out
