"""Audit of produced completions and training shards: what training will see.

Per sample: tokens, generated tokens (the loss-mask sum), answer tokens (from the quality gate's verdict),
truncation, thinking state, gate flags. A sample is a stub when the quality gate found its answer empty or stock
filler (its `stub` or `empty` check: quality/placeholders.py, the one definition); a real answer shorter than
`min_answer_tokens` tokens is counted as short, reported and never gated. The gate: the stub share must not
exceed `max_stub_fraction`; with both completions and shards at hand, it is judged on the shards. Samples
without a verdict (written before the gate existed) are never stubs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from dflash_queue.audit.stats import brief, describe, share
from dflash_queue.quality.checks import CHECKS
from dflash_queue.shards.completions import CompletionRecord
from dflash_queue.shards.training import TrainingShard


@dataclass(frozen=True)
class SampleRow:
    tokens: int
    generated: int
    # None when the record carries no verdict (then the generated count stands in).
    answer_tokens: int | None
    truncated: bool
    thinking: str
    flags: tuple[str, ...]
    decision: str


def completion_rows(records: Iterable[CompletionRecord]) -> Iterator[SampleRow]:
    for record in records:
        verdict = record.quality
        yield SampleRow(
            tokens=record.num_tokens,
            generated=record.generated_tokens,
            answer_tokens=verdict.answer_tokens if verdict else None,
            truncated="length" in record.turn_finish_reasons(),
            thinking=verdict.thinking if verdict else "unknown",
            flags=verdict.flags if verdict else (),
            decision=verdict.decision if verdict else "keep",
        )


def shard_rows(shard: TrainingShard) -> Iterator[SampleRow]:
    """One row per sample: the rows of a sample stored one sequence per turn are added up."""
    sums = shard.loss_mask_sums()
    lengths = (shard.offsets[1:] - shard.offsets[:-1]).tolist()
    has_verdicts = "quality" in shard.metadata
    by_sample: dict[str, list[int]] = {}
    for index, sample_id in enumerate(shard.sample_ids):
        by_sample.setdefault(sample_id, []).append(index)
    for rows in by_sample.values():
        quality = shard.quality[rows[-1]]
        yield SampleRow(
            tokens=sum(lengths[i] for i in rows),
            generated=sum(sums[i] for i in rows),
            answer_tokens=int(quality["answer_tokens"]) if has_verdicts else None,
            truncated=any(shard.finish_reasons[i] == "length" for i in rows),
            thinking=quality["thinking"] if has_verdicts else "unknown",
            flags=tuple(quality["flags"]),
            decision="flag" if quality["flags"] else "keep",
        )


def summarize_rows(rows: Iterable[SampleRow], *, min_answer_tokens: int, dropped: int = 0) -> dict[str, Any]:
    rows = list(rows)
    total = len(rows)
    stubs = sum(1 for r in rows if _is_stub(r))
    short = sum(1 for r in rows if not _is_stub(r) and _answer(r) < min_answer_tokens)
    flags = Counter(flag for r in rows for flag in r.flags)
    decisions = Counter(r.decision for r in rows)
    thinking = Counter(r.thinking for r in rows)
    return {
        "samples": total,
        "dropped_by_gate": dropped or decisions.get("drop", 0),
        "decisions": dict(decisions),
        "flags": {check: flags[check] for check in CHECKS if flags[check]},
        "flagged_share": share(sum(1 for r in rows if r.flags), total),
        "stubs": stubs,
        "stub_share": share(stubs, total),
        "short": short,
        "short_share": share(short, total),
        "truncated_share": share(sum(r.truncated for r in rows), total),
        "closed_thinking_share": share(thinking.get("closed", 0), total),
        "thinking": dict(thinking),
        "min_answer_tokens": min_answer_tokens,
        "answer_from": "verdicts" if all(r.answer_tokens is not None for r in rows) else "loss_mask",
        "tokens_per_sample": describe([r.tokens for r in rows]),
        "loss_mask_sum": describe([r.generated for r in rows]),
        "answer_tokens": describe([r.answer_tokens for r in rows if r.answer_tokens is not None]),
    }


STUB_CHECKS = ("stub", "empty")


def _is_stub(row: SampleRow) -> bool:
    return any(check in row.flags for check in STUB_CHECKS)


def _answer(row: SampleRow) -> int:
    return row.answer_tokens if row.answer_tokens is not None else row.generated


def output_lines(name: str, summary: dict[str, Any]) -> Iterator[str]:
    dropped = summary["dropped_by_gate"]
    if not dropped:
        yield f"{name}: {summary['samples']} samples"
    elif name == "training shards":  # dropped samples are not in the tensors, only in the metadata
        yield f"{name}: {summary['samples']} samples ({dropped} more dropped by the quality gate)"
    else:
        yield f"{name}: {summary['samples']} samples ({dropped} of them dropped by the quality gate)"
    yield f"  tokens per sample: {brief(summary['tokens_per_sample'])}"
    yield f"  loss_mask sum per sample: {brief(summary['loss_mask_sum'])}"
    if summary["answer_tokens"].get("count"):
        yield f"  answer tokens per sample: {brief(summary['answer_tokens'])}"
    yield f"  stubs (the gate's stub or empty check): {summary['stubs']} ({summary['stub_share']:.1%})"
    yield (
        f"  short (< {summary['min_answer_tokens']} answer tokens, reported, not gated): {summary['short']} "
        f"({summary['short_share']:.1%})"
    )
    yield f"  truncated: {summary['truncated_share']:.1%}; closed thinking block: {summary['closed_thinking_share']:.1%}"
    yield f"  thinking states: {', '.join(f'{k} {v}' for k, v in sorted(summary['thinking'].items())) or 'none'}"
    flags = ", ".join(f"{k} {v}" for k, v in summary["flags"].items()) or "none"
    yield f"  gate flags: {flags} (flagged share {summary['flagged_share']:.1%})"
