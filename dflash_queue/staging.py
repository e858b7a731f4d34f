"""Staging: read datasets into samples (valid, distinct, thinking decided, fitting the context) and count
what was left out. Pure: it knows nothing of queues; the producer (dflash_queue.producer) stages shards with it
and sends them.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dflash_queue.config import Config
from dflash_queue.data.length import TOO_LONG, LengthFilter
from dflash_queue.data.problems import BadRecord, ProblemLog
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.data.thinking import apply_thinking_policy


@dataclass
class EnqueueReport:
    # Valid, distinct samples read (before the length filter).
    samples: int = 0
    duplicates: int = 0
    # Samples in shards (after the length filter).
    staged: int = 0
    # Samples the chat template refused to render while they were counted (also bad records).
    refused: int = 0
    thinking_on: int = 0
    prompt_tokens: int = 0
    max_prompt_tokens: int = 0
    shards: int = 0
    enqueued: int = 0
    skipped_done: int = 0
    skipped_queued: int = 0
    # Rebuild only: shards sent again although the ledger showed them queued or in progress.
    resent_in_progress: int = 0
    # Shards the ledger showed done whose training file is not in storage: sent again.
    resent_missing: int = 0
    rebuild: bool = False
    # Rebuild only: the run name had been made with another config and was started over (what differed).
    restarted: list[str] = field(default_factory=list)
    shard_ids: list[str] = field(default_factory=list)
    pending_samples: int = 0
    problems: ProblemLog = field(default_factory=ProblemLog)
    too_long: ProblemLog = field(default_factory=ProblemLog)

    def lines(self) -> list[str]:
        out = [
            f"samples: {self.samples} ({self.duplicates} exact duplicates dropped, "
            f"{self.too_long.total} too long for the context skipped, "
            + (f"{self.refused} refused by the chat template, " if self.refused else "")
            + f"{self.staged} staged, "
            f"thinking on for {self.thinking_on})",
        ]
        if self.staged and self.prompt_tokens:
            out.append(
                f"prompt tokens: {self.prompt_tokens} (mean {self.prompt_tokens / self.staged:.0f}, "
                f"max {self.max_prompt_tokens})"
            )
        if self.rebuild:
            shards = (
                f"shards: {self.shards} ({self.enqueued} enqueued, {self.skipped_done} already done; rebuild: "
                f"ledger ignored, {self.resent_in_progress} of those enqueued it showed queued or in progress)"
            )
        else:
            shards = (
                f"shards: {self.shards} ({self.enqueued} enqueued, {self.skipped_done} already done, "
                f"{self.skipped_queued} already queued)"
            )
        out.append(shards)
        if self.restarted:
            out.append("rebuild: the run had been made with other settings and was started over:")
            out.extend("  " + line for line in self.restarted)
        if self.resent_missing:
            out.append(
                f"sent again: {self.resent_missing} shard(s) the ledger showed done have no training file in storage"
            )
        out.append(f"bad records: {self.problems.total}")
        out.extend("  " + line for line in self.problems.lines())
        if self.too_long.total:
            out.append(f"skipped as too long: {self.too_long.total}")
            out.extend("  " + line for line in self.too_long.lines())
        return out


def iter_samples(
    config: Config, paths: Iterable[str | Path], report: EnqueueReport, length_filter: LengthFilter | None = None
) -> Iterator[Sample]:
    """Valid, de-duplicated samples with their thinking decision that fit the context; everything else counted."""
    seen: set[str] = set()

    def distinct() -> Iterator[Sample]:
        for item in read_dataset(
            paths, max_record_bytes=config.dataset.max_record_bytes, regenerate=config.dataset.regenerate
        ):
            if isinstance(item, BadRecord):
                report.problems.add(item)
            elif item.id in seen:
                report.duplicates += 1
            else:
                seen.add(item.id)
                report.samples += 1
                yield apply_thinking_policy(item, config.dataset.thinking)

    if length_filter is None:
        for sample in distinct():
            report.staged += 1
            report.thinking_on += sample.thinking
            yield sample
        return
    for item in length_filter.filter(distinct()):
        if isinstance(item, BadRecord):
            if item.kind == TOO_LONG:
                report.too_long.add(item)
            else:
                report.refused += 1
                report.problems.add(item)
            continue
        report.staged += 1
        report.thinking_on += item.sample.thinking
        report.prompt_tokens += item.prompt_tokens
        report.max_prompt_tokens = max(report.max_prompt_tokens, item.prompt_tokens)
        yield item.sample


def batched(items: Iterable, size: int) -> Iterator[list]:
    batch: list = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def growing_batches(items: Iterable, largest: int) -> Iterator[list]:
    """Batches of 1, 2, 4, ... items, then `largest` at most."""
    batch: list = []
    size = 1
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
            size = min(2 * size, largest)
    if batch:
        yield batch


def checked_formatter(config: Config):
    """The target's chat template, refused (ConfigError, the message `doctor` gives) when it cannot do what
    `dataset.thinking` asks: checked before anything is staged or sent."""
    from transformers import AutoTokenizer

    from dflash_queue.engines.chat import ChatFormatter

    formatter = ChatFormatter(AutoTokenizer.from_pretrained(config.model.tokenizer_path))
    formatter.require_thinking_policy(config.dataset.thinking, config.source)
    return formatter


def build_length_filter(config: Config, formatter=None) -> LengthFilter | None:
    if not config.dataset.length_filter:
        return None
    formatter = formatter or checked_formatter(config)
    return LengthFilter(formatter, max_model_len=config.max_model_len(), budget=config.generation_budget)
