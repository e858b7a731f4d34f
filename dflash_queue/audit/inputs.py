"""Audit of an input dataset: what is in it, and whether its existing responses look like placeholders.

A response (any assistant turn) is a placeholder when its answer (the text after a `</think>`, if any) holds no
answer: nothing, or stock filler only ("OK.", "Sure.", "N/A", "TODO", "..."): the quality gate's own definition
(quality/placeholders.py). A real answer shorter than `min_answer_tokens` tokens (words when no tokenizer is
given; "4.", "Paris.") is counted as short, reported and never gated. The gate: the placeholder share must not
exceed `max_stub_fraction`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_queue.audit.stats import brief, counts_of, describe, share
from dflash_queue.data.length import LengthFilter, Refused, count_prompt_tokens
from dflash_queue.data.problems import BadRecord, ProblemLog
from dflash_queue.data.readers import ConversationRecord, read_conversations
from dflash_queue.data.samples import Sample
from dflash_queue.data.schemas import RecordError
from dflash_queue.data.selection import to_sample
from dflash_queue.data.thinking import apply_thinking_policy, decide_thinking
from dflash_queue.quality.placeholders import is_placeholder

THINK_END = "</think>"
BATCH = 2048


@dataclass(frozen=True)
class AuditSettings:
    min_answer_tokens: int = 8
    max_stub_fraction: float = 0.05
    max_record_bytes: int = 4 * 1024 * 1024
    regenerate: str = "last"
    # The thinking policy to apply (None: not reported).
    thinking: str | None = None
    # A ChatFormatter of the target's tokenizer; None: lengths in words, no prompt-token distribution.
    formatter: Any = None
    max_model_len: int = 0
    generation_budget: int = 0


def answer_text(content: str) -> str:
    """The answer part of a response: what follows the last `</think>`."""
    position = content.rfind("</think>")
    return content[position + len("</think>") :] if position >= 0 else content


def audit_dataset(paths: Iterable[str | Path], settings: AuditSettings) -> dict[str, Any]:
    paths = [str(p) for p in paths]
    problems = ProblemLog()
    schemas: Counter[str] = Counter()
    roles: Counter[str] = Counter()
    turns: list[int] = []
    with_system = 0
    seen: set[str] = set()
    duplicates = 0
    samples: list[Sample] = []
    prompt_tokens: list[int] = []
    thinking_rules: Counter[str] = Counter()
    thinking_on = 0
    responses = _Responses(settings)
    length_filter = (
        LengthFilter(settings.formatter, max_model_len=settings.max_model_len, budget=settings.generation_budget)
        if settings.formatter is not None and settings.max_model_len
        else None
    )

    for item in read_conversations(paths, max_record_bytes=settings.max_record_bytes):
        if isinstance(item, BadRecord):
            problems.add(item)
            continue
        messages = item.conversation.messages
        schemas[item.conversation.schema] += 1
        roles.update(m.role for m in messages)
        turns.append(len(messages))
        with_system += any(m.role == "system" for m in messages)
        for message in messages:
            if message.role == "assistant":
                responses.add(answer_text(message.content))
        sample = _sample(item, settings, problems)
        if sample is None:
            continue
        if sample.id in seen:
            duplicates += 1
            continue
        seen.add(sample.id)
        if settings.thinking is not None:
            if settings.thinking == "auto":
                on, rule = decide_thinking(sample)
                thinking_rules[f"{'on' if on else 'off'}: {rule}"] += 1
            sample = apply_thinking_policy(sample, settings.thinking)
            thinking_on += sample.thinking
        samples.append(sample)
        if len(samples) >= BATCH:
            prompt_tokens += _count(samples, settings, problems)
            samples = []
    prompt_tokens += _count(samples, settings, problems)
    conversations = len(turns)
    report: dict[str, Any] = {
        "kind": "dataset",
        "files": paths,
        "conversations": conversations,
        "samples": len(seen),
        "duplicates": duplicates,
        "bad_records": problems.total,
        "bad_record_kinds": dict(problems.counts),
        "bad_record_examples": [str(e) for kind in problems.examples.values() for e in kind],
        "schemas": dict(schemas),
        "roles": dict(roles),
        "turns_per_conversation": counts_of(turns),
        "system_prompt_share": share(with_system, conversations),
        "prompt_tokens": describe(prompt_tokens) if settings.formatter is not None else None,
        "too_long": sum(1 for t in prompt_tokens if length_filter and t > length_filter.limit),
        "max_model_len": settings.max_model_len or None,
        "thinking": None,
        "responses": responses.summary(),
    }
    if settings.thinking is not None:
        report["thinking"] = {"policy": settings.thinking, "on": thinking_on, "rules": dict(thinking_rules)}
    report["stub_fraction"] = report["responses"]["placeholder_share"]
    report["max_stub_fraction"] = settings.max_stub_fraction
    report["passed"] = report["stub_fraction"] <= settings.max_stub_fraction
    return report


def _sample(item: ConversationRecord, settings: AuditSettings, problems: ProblemLog) -> Sample | None:
    try:
        return to_sample(item.conversation, source=item.source, regenerate=settings.regenerate)  # type: ignore[arg-type]
    except RecordError as exc:
        problems.add(BadRecord(item.file, item.line, exc.reason, exc.key, unit=item.unit))
        return None


def _count(samples: list[Sample], settings: AuditSettings, problems: ProblemLog) -> list[int]:
    """Prompt tokens of the samples the chat template renders; the ones it refuses are bad records."""
    if settings.formatter is None or not samples:
        return []
    counts = []
    for sample, tokens in zip(samples, count_prompt_tokens(settings.formatter, samples)):
        if isinstance(tokens, Refused):
            problems.add(tokens.record(sample))
        else:
            counts.append(tokens)
    return counts


class _Responses:
    """Existing responses: their lengths, and which look like placeholders."""

    def __init__(self, settings: AuditSettings) -> None:
        self.settings = settings
        self.pending: list[str] = []
        self.lengths: list[int] = []
        self.placeholders = 0
        self.short = 0
        self.examples: Counter[str] = Counter()

    def add(self, text: str) -> None:
        self.pending.append(text)
        if len(self.pending) >= BATCH:
            self._flush()

    def _flush(self) -> None:
        texts, self.pending = self.pending, []
        if self.settings.formatter is not None:
            lengths = self.settings.formatter.count_tokens([t.strip() for t in texts])
        else:
            lengths = [len(t.split()) for t in texts]
        for text, length in zip(texts, lengths):
            self.lengths.append(length)
            if is_placeholder(text.rsplit(THINK_END, 1)[-1]):
                self.placeholders += 1
                self.examples[text.strip()[:60]] += 1
            elif length < self.settings.min_answer_tokens:
                self.short += 1

    def summary(self) -> dict[str, Any]:
        self._flush()
        return {
            "count": len(self.lengths),
            "placeholders": self.placeholders,
            "placeholder_share": share(self.placeholders, len(self.lengths)),
            "short": self.short,
            "short_share": share(self.short, len(self.lengths)),
            "length_unit": "tokens" if self.settings.formatter is not None else "words",
            "min_answer_tokens": self.settings.min_answer_tokens,
            "length": describe(self.lengths),
            "most_common_placeholders": [[t, n] for t, n in self.examples.most_common(8)],
        }


def dataset_lines(report: dict[str, Any]) -> Iterator[str]:
    yield f"dataset: {', '.join(report['files'])}"
    yield (
        f"  conversations {report['conversations']}, distinct samples {report['samples']}, "
        f"duplicates {report['duplicates']}, bad records {report['bad_records']}"
    )
    for example in report["bad_record_examples"][:10]:
        yield f"    {example}"
    yield f"  schemas: {_pairs(report['schemas'])}"
    yield f"  roles: {_pairs(report['roles'])}"
    yield f"  turns per conversation: {_pairs(report['turns_per_conversation'])}"
    yield f"  system prompt share: {report['system_prompt_share']:.1%}"
    if report["prompt_tokens"] is not None:
        yield f"  prompt tokens (chat template): {brief(report['prompt_tokens'])}"
        if report["max_model_len"]:
            yield f"  too long for max_model_len {report['max_model_len']}: {report['too_long']}"
    else:
        yield "  prompt tokens: pass -c CONFIG for counts with the target's tokenizer"
    if report["thinking"] is not None:
        thinking = report["thinking"]
        yield f"  thinking ({thinking['policy']}): on for {thinking['on']} of {report['samples']}"
        if thinking["rules"]:
            yield f"    {_pairs(thinking['rules'])}"
    responses = report["responses"]
    yield (
        f"  responses: {responses['count']}, length in {responses['length_unit']}: {brief(responses['length'])}"
    )
    yield (
        f"  placeholder responses: {responses['placeholders']} of {responses['count']} "
        f"({responses['placeholder_share']:.1%}; empty or stock filler, as the quality gate's stub check)"
    )
    yield (
        f"  short responses: {responses['short']} ({responses['short_share']:.1%}; real answers under "
        f"{responses['min_answer_tokens']} {responses['length_unit']}: reported, not gated)"
    )
    for text, count in responses["most_common_placeholders"][:5]:
        yield f"    {count} x {text!r}"


def _pairs(mapping: dict[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(mapping.items(), key=lambda kv: (-kv[1], kv[0]))) or "none"
