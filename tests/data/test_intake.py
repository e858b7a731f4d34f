"""Per-file intake: samples and bad records counted against the file they came from, whatever its name holds."""

from __future__ import annotations

from dflash_queue.data.intake import Intake, StagingCounts, intake_refusal
from dflash_queue.data.problems import BadRecord, ProblemLog


def test_samples_count_against_their_file_even_with_colons_and_hashes_in_its_name():
    intake = Intake()
    lines, rows = "runs/a#1.jsonl", "exports/x:y.json"
    intake.bad(BadRecord(lines, 1, "malformed JSON"))
    intake.bad(BadRecord(rows, 0, "malformed JSON", unit="row"))
    intake.sample(f"{lines}:2")
    intake.sample(f"{rows}#1")
    intake.sample(f"{rows}#2")
    assert {name: (t.records, t.bad) for name, t in intake.files.items()} == {lines: (2, 1), rows: (3, 1)}
    assert list(intake.over(0.4)) == [lines] and not intake.over(0.5)


def test_the_refusal_quotes_the_first_problems_of_the_files_over_the_share_in_file_order():
    problems, intake = ProblemLog(), Intake()
    for record in [BadRecord("b.jsonl", 3, "empty conversation", "conversations"),
                   BadRecord("b.jsonl", 1, "malformed JSON"), BadRecord("a.jsonl", 9, "malformed JSON")]:
        problems.add(record)
        intake.bad(record)
    intake.sample("a.jsonl:1")
    intake.sample("a.jsonl:2")
    message = intake_refusal(intake, problems, StagingCounts(2, 0, 0), max_bad_share=0.5, source="job.toml")
    assert message is not None
    assert message.startswith("b.jsonl: 2 of 2 record(s) are bad (100%), more than dataset.max_bad_share = 0.5")
    assert "a.jsonl" not in message  # 1 of 3: within the share
    assert message.endswith("  b.jsonl:1: malformed JSON\n  b.jsonl:3 [conversations]: empty conversation")
    assert intake_refusal(intake, problems, StagingCounts(2, 0, 0), max_bad_share=1.0, source="job.toml") is None
