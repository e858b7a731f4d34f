"""Prompt staging: read datasets into samples (valid, distinct, thinking decided, fitting the context) and count
what was left out. Pure: it knows nothing of queues; the producer (dflash_queue.producer) stages shards with it
and sends them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import cast

from dflash_queue.config import Config
from dflash_queue.data.config import DatasetConfig
from dflash_queue.data.intake import Intake, StagingCounts, intake_refusal
from dflash_queue.data.length import TOO_LONG, LengthFilter
from dflash_queue.data.preparation import Preparation, prepared_chunks
from dflash_queue.data.problems import BadRecord, ProblemLog
from dflash_queue.data.samples import EncodedSample, Sample
from dflash_queue.engines.config import ModelConfig

# Automatic staging processes (`staging_processes`): input files this large (compressed or not), on this many
# cores, are prepared by a pool of processes.
AUTO_MIN_BYTES = 64 * 1024 * 1024
AUTO_MIN_CORES = 4
AUTO_MAX_PROCESSES = 32


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
    # Output that stored nothing, made with other settings, taken over by this config (one line; "" when none).
    took_over: str = ""
    shard_ids: list[str] = field(default_factory=list)
    # Samples per shard, of every shard of the dataset (epoch 0's shards for a live dataset).
    shard_samples: dict[str, int] = field(default_factory=dict)
    pending_samples: int = 0
    problems: ProblemLog = field(default_factory=ProblemLog)
    too_long: ProblemLog = field(default_factory=ProblemLog)
    # Records and bad records per dataset file.
    intake: Intake = field(default_factory=Intake)

    def refusal(self, dataset: DatasetConfig, source: str) -> str | None:
        """Why what was read so far must not be staged (data/intake.py), or None."""
        counts = StagingCounts(self.staged, self.duplicates, self.too_long.total)
        return intake_refusal(
            self.intake, self.problems, counts, max_bad_share=dataset.max_bad_share, source=source
        )

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
        if self.took_over:
            out.append(self.took_over)
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
    dataset: DatasetConfig,
    model: ModelConfig,
    paths: Iterable[str | Path],
    report: EnqueueReport,
    length_filter: LengthFilter | None = None,
    *,
    processes: int | None = None,
) -> Iterator[Sample]:
    """Valid, de-duplicated samples with their thinking decision that fit the context; everything else counted.
    `processes`: how many processes prepare the records (default: `staging_processes`)."""
    for item in _admitted(dataset, model, list(paths), report, length_filter, processes, encoded=False):
        yield cast(Sample, item)


def iter_encoded(
    dataset: DatasetConfig,
    model: ModelConfig,
    paths: Iterable[str | Path],
    report: EnqueueReport,
    length_filter: LengthFilter | None = None,
    *,
    processes: int | None = None,
) -> Iterator[EncodedSample]:
    """What `iter_samples` yields, each sample's prompt-shard record encoded where it was parsed: with a pool,
    the calling process is left to remove duplicates and count."""
    for item in _admitted(dataset, model, list(paths), report, length_filter, processes, encoded=True):
        yield cast(EncodedSample, item)


def _admitted(
    dataset: DatasetConfig,
    model: ModelConfig,
    paths: list[str | Path],
    report: EnqueueReport,
    length_filter: LengthFilter | None,
    processes: int | None,
    *,
    encoded: bool,
) -> Iterator[Sample | EncodedSample]:
    preparation = Preparation(
        dataset.thinking,
        dataset.regenerate,
        partial(load_formatter, model.tokenizer_path) if length_filter is not None else None,
        encoded=encoded,
    )
    chunks = prepared_chunks(
        paths,
        preparation,
        max_record_bytes=dataset.max_record_bytes,
        formatter=length_filter.formatter if length_filter is not None else None,
        processes=staging_processes(dataset, paths) if processes is None else processes,
    )
    seen: set[str] = set()
    for items, counts in chunks:
        for item, tokens in zip(items, counts):
            if isinstance(item, BadRecord):
                report.problems.add(item)
                report.intake.bad(item)
                continue
            report.intake.sample(item.source)
            if item.id in seen:
                report.duplicates += 1
                continue
            seen.add(item.id)
            report.samples += 1
            if length_filter is not None:
                assert tokens is not None
                judged = length_filter.judge(item, tokens)
                if isinstance(judged, BadRecord):
                    if judged.kind == TOO_LONG:
                        report.too_long.add(judged)
                    else:
                        report.refused += 1
                        report.problems.add(judged)
                        report.intake.refused(item.source)
                    continue
                report.prompt_tokens += judged.prompt_tokens
                report.max_prompt_tokens = max(report.max_prompt_tokens, judged.prompt_tokens)
            report.staged += 1
            report.thinking_on += item.thinking
            yield item


def staging_processes(dataset: DatasetConfig, paths: Iterable[str | Path], cores: int | None = None) -> int:
    """`dataset.staging_processes`, or when 0: one per core but one (at most AUTO_MAX_PROCESSES) on machines of
    AUTO_MIN_CORES or more for input files of AUTO_MIN_BYTES or more, else 1. Starting the processes costs
    seconds, and on fewer cores one process that tokenizes on a second thread is as fast."""
    if dataset.staging_processes:
        return dataset.staging_processes
    cores = cores or os.cpu_count() or 1
    size = sum(Path(p).stat().st_size for p in paths if Path(p).is_file())
    if cores < AUTO_MIN_CORES or size < AUTO_MIN_BYTES:
        return 1
    return min(cores - 1, AUTO_MAX_PROCESSES)


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


def checked_formatter(model: ModelConfig, dataset: DatasetConfig, source: str):
    """The target's chat template, refused (ConfigError, the message `doctor` gives, naming the config file
    `source`) when it cannot do what `dataset.thinking` asks: checked before anything is staged or sent."""
    formatter = load_formatter(model.tokenizer_path)
    formatter.require_thinking_policy(dataset.thinking, source)
    return formatter


def load_formatter(tokenizer_path: str):
    """The chat formatter of a tokenizer (and its chat template)."""
    from transformers import AutoTokenizer

    from dflash_queue.data.chat_template import ChatFormatter

    return ChatFormatter(AutoTokenizer.from_pretrained(tokenizer_path))


def build_length_filter(config: Config, formatter=None) -> LengthFilter | None:
    """Takes the whole Config: the context length and generation budget span the dataset, model and generate
    sections (Config.max_model_len, Config.generation_budget)."""
    if not config.dataset.length_filter:
        return None
    formatter = formatter or checked_formatter(config.model, config.dataset, config.source)
    return LengthFilter(formatter, max_model_len=config.max_model_len(), budget=config.generation_budget)
