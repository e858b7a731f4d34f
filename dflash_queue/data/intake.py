"""How much of each dataset file was usable, and the refusal of datasets that gave nothing to stage or too many
bad records (`dataset.max_bad_share`): a file in another format, or a broken export, is stopped with what is
wrong with it instead of staging whatever few records happened to parse."""

from __future__ import annotations

from dataclasses import dataclass, field

from dflash_queue.data.problems import BadRecord, ProblemLog

# Problems quoted in a refusal (file, line, key and reason each).
SHOWN_PROBLEMS = 5


@dataclass
class FileIntake:
    records: int = 0
    bad: int = 0

    @property
    def share(self) -> float:
        return self.bad / self.records if self.records else 0.0


@dataclass
class Intake:
    """Records and bad records per dataset file, in the order the files were read."""

    files: dict[str, FileIntake] = field(default_factory=dict)

    def sample(self, source: str) -> None:
        """A valid record (a sample, a duplicate), known by its sample's source (`file:line` or `file#row`)."""
        self._file(_file_of(source, self.files)).records += 1

    def bad(self, record: BadRecord) -> None:
        tally = self._file(record.file)
        tally.records += 1
        tally.bad += 1

    def refused(self, source: str) -> None:
        """A sample counted already that turned out bad (the chat template refused it)."""
        self._file(_file_of(source, self.files)).bad += 1

    @property
    def records(self) -> int:
        return sum(tally.records for tally in self.files.values())

    def over(self, max_bad_share: float) -> dict[str, FileIntake]:
        """The files whose bad records are more than `max_bad_share` of their records."""
        return {name: tally for name, tally in self.files.items() if tally.share > max_bad_share}

    def _file(self, name: str) -> FileIntake:
        tally = self.files.get(name)
        if tally is None:
            tally = self.files[name] = FileIntake()
        return tally


def _file_of(source: str, known: dict[str, FileIntake]) -> str:
    """The file of a sample's source: `file:line` for line-oriented files, `file#row` for the others (a file name
    may hold either character: the one that leaves a file already seen wins)."""
    by_line = source.rpartition(":")[0]
    if by_line in known:
        return by_line
    by_row = source.rpartition("#")[0]
    if by_row in known:
        return by_row
    return by_line or by_row or source


@dataclass(frozen=True)
class StagingCounts:
    """What staging made of the records, besides the per-file intake."""

    staged: int
    duplicates: int
    too_long: int


def intake_refusal(
    intake: Intake, problems: ProblemLog, counts: StagingCounts, *, max_bad_share: float, source: str
) -> str | None:
    """Why the datasets must not be staged, or None: no usable sample at all (every record bad, a duplicate or too
    long, or no record), or a file whose bad records are more than `max_bad_share` of its records. `source`: the
    config file, named in the advice."""
    files = ", ".join(intake.files) or "the datasets"
    if counts.staged == 0:
        total, bad = intake.records, sum(t.bad for t in intake.files.values())
        return _with_problems(
            f"{files}: nothing to stage: 0 usable samples of {total} record(s) ({bad} bad, {counts.duplicates} "
            f"exact duplicates, {counts.too_long} too long for the context). "
            + (
                "Check the file's format (docs/data-and-quality.md lists the containers and schemas read)."
                if bad
                else "Every prompt needs room for the generation: see dataset.max_model_len and "
                f"dataset.generation_budget in {source}."
                if counts.too_long
                else ""
            ),
            problems, list(intake.files),
        )
    over = intake.over(max_bad_share)
    if not over:
        return None
    lines = [
        f"{name}: {tally.bad} of {tally.records} record(s) are bad ({tally.share:.0%}), more than "
        f"dataset.max_bad_share = {max_bad_share:g} allows"
        for name, tally in over.items()
    ]
    return _with_problems(
        "\n".join(lines)
        + f"\nA file in another format or a broken export? Fix or leave out the file, or raise dataset.max_bad_share "
        f"in {source} (1 lets any share through).",
        problems, list(over),
    )


def _with_problems(message: str, problems: ProblemLog, files: list[str]) -> str:
    order = {name: position for position, name in enumerate(files)}
    examples = sorted(
        (record for kept in problems.examples.values() for record in kept if record.file in order),
        key=lambda record: (order[record.file], record.line),
    )
    if not examples:
        return message.rstrip()
    shown = "\n".join(f"  {record}" for record in examples[:SHOWN_PROBLEMS])
    return f"{message.rstrip()}\nfirst problems:\n{shown}"
