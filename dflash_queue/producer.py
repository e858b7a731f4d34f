"""The producer: read datasets, stage prompt shards in storage, enqueue one generate task per shard.

read -> dedupe -> thinking policy -> length filter (real tokenizer + chat template) -> shards -> stage -> send.

Re-running it is safe: a shard whose training file exists is done, and a shard the ledger shows queued or
in progress already has a message; both are skipped. Shard ids derive from sample ids, so the same dataset
always makes the same shards.

Storage has the last word on "done": a shard the ledger shows done whose training file is not in storage is
sent again. Before anything is staged, the run's identity (dflash_queue.run_identity) is checked against what
the broker's run name and the storage location were made with; another model, other settings or another
storage is refused with what differs, never skipped as done.

Rebuild (`rebuild=True`, `enqueue --rebuild`): after the broker was lost or restored from an old copy, the
ledger may show shards queued whose messages are gone. Storage alone then decides: every shard without a
training file is sent again. Tasks are idempotent (a shard whose completions are stored goes straight to
extraction), so a shard that still had a message costs one skipped delivery, never a second copy. A rebuild
under a run name made with another config starts that run over (shard states and counters reset).

Speed: token counting is batched through the fast tokenizer (on a second thread); shards are handled in
groups, with one ledger read and one ledger write per group, and a group's prompt files are written by a
thread pool while the next group is read. A shard's message is sent only once its prompt file is stored, and
the shard is marked queued before its message is sent, so a worker's state update is never overwritten.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from dflash_queue.config import Config
from dflash_queue.data.length import LengthFilter
from dflash_queue.data.problems import BadRecord, ProblemLog
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.data.thinking import apply_thinking_policy
from dflash_queue.ledger import DONE, IN_PROGRESS_OR_DONE, Ledger
from dflash_queue.run_identity import MANIFEST_KEY, RunIdentity, broker_mismatch, storage_mismatch
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id
from dflash_queue.storage import Storage, open_storage
from dflash_queue.storage.keys import SHARDS, prompts_key, shard_id_of

# Shards per ledger round trip. The first groups are smaller (1, 2, 4, ...) so that workers get their first
# messages while the rest is still being staged.
SHARD_GROUP = 64
# Concurrent prompt-file writes (storage latency, fsync, object-store PUTs).
STORAGE_THREADS = 8


@dataclass
class _StagedGroup:
    group: list[list[Sample]]
    to_send: list[tuple[str, int]]
    writes: list[Future]


@dataclass
class EnqueueReport:
    # Valid, distinct samples read (before the length filter).
    samples: int = 0
    duplicates: int = 0
    # Samples in shards (after the length filter).
    staged: int = 0
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
            f"{self.too_long.total} too long for the context skipped, {self.staged} staged, "
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
            report.too_long.add(item)
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


class Producer:
    def __init__(
        self,
        config: Config,
        ledger: Ledger,
        storage: Storage | None = None,
        *,
        length_filter: LengthFilter | None | bool = True,
        formatter=None,
    ) -> None:
        """`formatter`: the chat template already checked against the thinking policy (`checked_formatter`)."""
        self.config = config
        self.ledger = ledger
        self.storage = storage or open_storage(config.storage)
        self.fingerprint = config.fingerprint()
        formatter = formatter or checked_formatter(config)
        self._restarted: list[str] | None = None  # what claim_run found different, once it ran
        self.length_filter = build_length_filter(config, formatter) if length_filter is True else length_filter or None

    def enqueue(
        self,
        paths: Iterable[str | Path],
        *,
        on_shard: Callable[[int], None] | None = None,
        send: Callable[[str, int, str], None] | None = None,
        rebuild: bool = False,
    ) -> EnqueueReport:
        """Stage and enqueue every shard not done or queued. `on_shard(n_samples)` reports progress.

        `rebuild`: ignore the ledger and enqueue every shard whose training file is not in storage.
        """
        send = send or _send_generate
        report = EnqueueReport(rebuild=rebuild)
        report.restarted = self.claim_run(rebuild=rebuild)
        done = {shard_id_of(key) for key in self.storage.list(SHARDS + "/")}
        samples = iter_samples(self.config, paths, report, self.length_filter)
        with ThreadPoolExecutor(max_workers=STORAGE_THREADS, thread_name_prefix="dfq-stage") as pool:
            pending: _StagedGroup | None = None
            for group in growing_batches(batched(samples, self.config.dataset.shard_size), SHARD_GROUP):
                staged = self._stage_group(group, done, report, pool)
                if pending is not None:
                    self._send_group(pending, report, send, on_shard)
                pending = staged
            if pending is not None:
                self._send_group(pending, report, send, on_shard)
        self.ledger.add(
            {
                "enqueued_samples": report.staged,
                "bad_records": report.problems.total,
                "duplicates": report.duplicates,
                "skipped_too_long": report.too_long.total,
            }
        )
        return report

    def claim_run(self, *, rebuild: bool = False) -> list[str]:
        """Check that the storage location and the broker's run name were made with this config, and record
        that they are. A mismatch raises RunMismatch, except that `rebuild` starts the broker's run over: its
        shard states and counters are reset (returns what differed; [] when nothing did). Checked once per
        producer."""
        if self._restarted is not None:
            return self._restarted
        mine = RunIdentity.of(self.config, self.storage.url)
        if self.storage.exists(MANIFEST_KEY):
            stored = RunIdentity.from_json(self.storage.read_bytes(MANIFEST_KEY))
            if stored.fingerprint != mine.fingerprint:
                raise storage_mismatch(stored, mine)
        recorded_text = self.ledger.claim_identity(mine.to_json())
        restarted: list[str] = []
        if recorded_text is not None:
            recorded = RunIdentity.from_json(recorded_text)
            if recorded.fingerprint != mine.fingerprint or recorded.storage != mine.storage:
                if not rebuild:
                    raise broker_mismatch(self.config.run.name, recorded, mine)
                restarted = recorded.differences(mine)
                self.ledger.reset()
                self.ledger.replace_identity(mine.to_json())
        if not self.storage.exists(MANIFEST_KEY):
            self.storage.write_bytes(MANIFEST_KEY, mine.to_json().encode() + b"\n")
        self._restarted = restarted
        return restarted

    def _stage_group(
        self, group: list[list[Sample]], done: set[str], report: EnqueueReport, pool: ThreadPoolExecutor
    ) -> _StagedGroup:
        """Skip what is done or queued; start writing the prompt files of the rest."""
        shard_ids = [prompt_shard_id(shard) for shard in group]
        states = self.ledger.states(shard_ids)
        staged = _StagedGroup(group, [], [])
        for shard_id, shard in zip(shard_ids, group):
            report.shards += 1
            report.shard_ids.append(shard_id)
            state = states.get(shard_id)
            # Done only when its training file is in storage, whatever the ledger says.
            in_progress = state in IN_PROGRESS_OR_DONE and state != DONE
            if shard_id in done:
                report.skipped_done += 1
            elif in_progress and not report.rebuild:
                report.skipped_queued += 1
                report.pending_samples += len(shard)
            else:
                report.resent_in_progress += int(in_progress)  # only a rebuild gets here with one
                report.resent_missing += int(state == DONE)
                # Content-addressed key: rewriting it writes the same bytes, so no existence check is needed.
                data = encode_prompts(shard)
                staged.writes.append(pool.submit(self.storage.write_bytes, prompts_key(shard_id), data))
                staged.to_send.append((shard_id, len(shard)))
        return staged

    def _send_group(
        self,
        staged: _StagedGroup,
        report: EnqueueReport,
        send: Callable[[str, int, str], None],
        on_shard: Callable[[int], None] | None,
    ) -> None:
        """Once the group's prompt files are stored: mark its shards queued, then send their messages."""
        wait(staged.writes)
        for write in staged.writes:
            write.result()  # a failed write raises here, before anything of this group is queued
        self.ledger.mark_queued(dict(staged.to_send))
        for position, (shard_id, size) in enumerate(staged.to_send):
            try:
                send(shard_id, size, self.fingerprint)
            except BaseException:
                # Nothing was sent for these: leave no "queued" state that would make a rerun skip them.
                self.ledger.forget([s for s, _ in staged.to_send[position:]])
                raise
            report.enqueued += 1
            report.pending_samples += size
        if on_shard:
            for shard in staged.group:
                on_shard(len(shard))


def _send_generate(shard_id: str, num_samples: int, fingerprint: str) -> None:
    from dflash_queue.lanes.registry import FIRST_LANE
    from dflash_queue.queue.tasks import send_to_lane

    send_to_lane(FIRST_LANE.name, shard_id, num_samples, fingerprint)
