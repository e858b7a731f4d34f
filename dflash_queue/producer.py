"""The producer: stage prompt shards in storage and send one task per shard to the first lane.

samples (dflash_queue.prompt_staging: read -> dedupe -> thinking policy -> length filter) -> shards -> prompt files
-> send.

Re-running it is safe: a shard whose training file exists is done, and a shard the ledger shows queued or
in progress already has a message; both are skipped. Shard ids derive from sample ids, so the same dataset
always makes the same shards.

Storage has the last word on "done": a shard the ledger shows done whose training file is not in storage is
sent again. Before anything is staged, the run's identity (dflash_queue.runstate.run_identity) is checked against what
the broker's run name and the storage location were made with; another model, other settings or another
storage is refused with what differs, never skipped as done.

Rebuild (`rebuild=True`, `enqueue --rebuild`): after the broker was lost or restored from an old copy, the
ledger may show shards queued whose messages are gone. Storage alone then decides: every shard without a
training file is sent again. Tasks are idempotent (a shard whose completions are stored goes straight to
extraction), so a shard that still had a message costs one skipped delivery, never a second copy. A rebuild
under a run name made with another config starts that run over (shard states and counters reset).

Datasets that give no usable sample, or a file whose bad records pass `dataset.max_bad_share`, are refused
(DatasetRefused, data/intake.py). No message leaves before PROBE_RECORDS records are read and judged fit, so a
dataset in the wrong format is refused with nothing enqueued (its prompt files may be in storage: staged, never
sent); a share that passes the limit only later is refused at the end, the shards sent before it staying queued.

Speed: token counting is batched through the fast tokenizer (on a second thread); shards are handled in
groups, with one ledger read and one ledger write per group, and a group's prompt files are written by a
thread pool while the next group is read. A shard's message is sent only once its prompt file is stored, and
the shard is marked queued before its message is sent, so a worker's state update is never overwritten.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from dflash_queue.config import Config
from dflash_queue.data.length import LengthFilter
from dflash_queue.data.preparation import batched
from dflash_queue.data.samples import EncodedSample
from dflash_queue.errors import DatasetRefused
from dflash_queue.prompt_staging import (
    EnqueueReport,
    build_length_filter,
    checked_formatter,
    growing_batches,
    iter_encoded,
)
from dflash_queue.runstate.ledger import DONE, IN_PROGRESS_OR_DONE, Ledger
from dflash_queue.runstate.run_identity import (
    MANIFEST_KEY,
    RunIdentity,
    broker_mismatch,
    storage_mismatch,
    takeover_note,
)
from dflash_queue.runstate.window import ShardWindow
from dflash_queue.shards.keys import holds_anything_made, prompts_key, stored_shard_ids
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id
from dflash_queue.storage import Storage, open_storage

# Shards per ledger round trip. The first groups are smaller (1, 2, 4, ...) so that workers get their first
# messages while the rest is still being staged.
SHARD_GROUP = 64
# Concurrent prompt-file writes (storage latency, fsync, object-store PUTs).
STORAGE_THREADS = 8
# Records read before the first message may leave: enough to tell a dataset in the wrong format (whose every
# record, or nearly, is bad) from one with a few bad records, without holding the workers back long.
PROBE_RECORDS = 1024


@dataclass
class _StagedGroup:
    # Samples per shard: the samples themselves are dropped once their prompt files are being written.
    sizes: list[int]
    to_send: list[tuple[str, int]]
    writes: list[Future]


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
        """`formatter`: the chat template already checked against the thinking policy (`checked_formatter`). Takes
        the whole Config: a run's fingerprint and identity (`claim_run`) are made of all its output settings."""
        self.config = config
        self.ledger = ledger
        self.storage = storage or open_storage(config.storage)
        self.fingerprint = config.fingerprint()
        formatter = formatter or checked_formatter(config.model, config.dataset, config.source)
        self._restarted: list[str] | None = None  # what claim_run found different, once it ran
        # What claim_run took over (output that stored nothing, made with other settings), in one line.
        self.took_over = ""
        self.length_filter = build_length_filter(config, formatter) if length_filter is True else length_filter or None

    def enqueue(
        self,
        paths: Iterable[str | Path],
        *,
        on_shard: Callable[[int], None] | None = None,
        send: Callable[[str, int, str], None] | None = None,
        rebuild: bool = False,
        on_total: Callable[[int], None] | None = None,
    ) -> EnqueueReport:
        """Stage and enqueue every shard not done or queued. `on_shard(n_samples)` reports progress;
        `on_total(n_samples)`, once every file is read, how many samples it will have reported in all.

        `rebuild`: ignore the ledger and enqueue every shard whose training file is not in storage.
        """
        send = send or _send_generate
        report = EnqueueReport(rebuild=rebuild)
        report.restarted = self.claim_run(rebuild=rebuild)
        report.took_over = self.took_over
        done = stored_shard_ids(self.storage)
        samples = iter_encoded(self.config.dataset, self.config.model, paths, report, self.length_filter)
        # Staged groups wait here, prompt files written, until the records read so far are judged fit to send.
        held: list[_StagedGroup] = []
        with ThreadPoolExecutor(max_workers=STORAGE_THREADS, thread_name_prefix="dfq-stage") as pool:
            for group in growing_batches(batched(samples, self.config.dataset.shard_size), SHARD_GROUP):
                held.append(self._stage_group(group, done, report, pool))
                if len(held) > 1 and self._may_send(report):
                    for staged in held[:-1]:
                        self._send_group(staged, report, send, on_shard)
                    del held[:-1]
            if on_total:
                on_total(report.staged)
            refusal = report.refusal(self.config.dataset, self.config.source)
            if refusal is not None and not report.enqueued:
                raise DatasetRefused(f"{refusal}\nNothing was enqueued.")
            for staged in held:
                self._send_group(staged, report, send, on_shard)
        # Every shard of the dataset is now known: a live dataset can split epoch 0 among its ranks.
        ShardWindow(self.ledger.client, self.config.run.name).seal_epoch(0, report.shard_samples)
        self.ledger.add(
            {
                "enqueued_samples": report.staged,
                "bad_records": report.problems.total,
                "duplicates": report.duplicates,
                "skipped_too_long": report.too_long.total,
            }
        )
        if refusal is not None:
            raise DatasetRefused(
                f"{refusal}\n{report.enqueued} shard(s) of the datasets were enqueued before the share was known "
                "(it was within dataset.max_bad_share over the first records): they stay queued."
            )
        return report

    def _may_send(self, report: EnqueueReport) -> bool:
        """Whether the records read so far let messages leave: PROBE_RECORDS of them read, some usable and no file
        over dataset.max_bad_share. Until then a dataset in the wrong format is refused with nothing enqueued;
        after, a share that passes the limit later is refused at the end, its earlier shards queued."""
        if report.enqueued:
            return True
        return report.intake.records >= PROBE_RECORDS and report.staged > 0 and not report.intake.over(
            self.config.dataset.max_bad_share
        )

    def claim_run(self, *, rebuild: bool = False) -> list[str]:
        """Check that the storage location and the broker's run name were made with this config, and record
        that they are. A mismatch raises RunMismatch, but for output that stored nothing yet and `rebuild`:

        - a storage location holding staged prompts only (no completion, no training shard), made with other
          settings (a typo that failed the first run), is taken over: recorded as this config's, and so is the
          broker's run that staged into it, started over (its shard states and counters reset, its waiting
          messages dropped), unless a worker holds a message of it. `took_over` says so in one line;
        - `rebuild` starts the broker's run over: its shard states and counters are reset.

        Returns what differed in the broker's run started over ([] when nothing did). Checked once per producer."""
        if self._restarted is not None:
            return self._restarted
        mine = RunIdentity.of(self.config, self.storage.url)
        manifest_stored = self.storage.exists(MANIFEST_KEY)
        replaced: RunIdentity | None = None
        if manifest_stored:
            stored = RunIdentity.from_json(self.storage.read_bytes(MANIFEST_KEY))
            if stored.made_otherwise(mine):
                if holds_output(self.storage):
                    raise storage_mismatch(stored, mine)
                replaced = stored
        recorded_text = self.ledger.claim_identity(mine.to_json())
        restarted: list[str] = []
        broker_taken: RunIdentity | None = None
        if recorded_text is not None:
            recorded = RunIdentity.from_json(recorded_text)
            if recorded.made_otherwise(mine) or recorded.storage != mine.storage:
                if self._may_take_over(recorded, mine):
                    broker_taken = recorded
                elif not rebuild:
                    raise broker_mismatch(self.config.run.name, recorded, mine)
                else:
                    restarted = recorded.differences(mine)
                self.ledger.reset()
                self.ledger.replace_identity(mine.to_json())
        if broker_taken is not None:
            self._drop_messages_of(broker_taken)
        taken = replaced or broker_taken
        if taken is not None:
            self.took_over = takeover_note(taken, mine, self.config.run.name, broker=broker_taken is not None)
        if not manifest_stored or replaced is not None:
            self.storage.write_bytes(MANIFEST_KEY, mine.to_json().encode() + b"\n")
        self._restarted = restarted
        return restarted

    def _may_take_over(self, recorded: RunIdentity, mine: RunIdentity) -> bool:
        """Whether the broker's run made with `recorded` may be started over without --rebuild: it staged into
        this storage location, which holds nothing made (no completion, no training shard), and no worker holds a
        message of it (one could be writing its output now)."""
        from dflash_queue.queue.stale_messages import taken_with

        return (
            recorded.storage == mine.storage
            and not holds_output(self.storage)
            and not taken_with(self.ledger.client, recorded.fingerprint)
        )

    def _drop_messages_of(self, recorded: RunIdentity) -> None:
        from dflash_queue.lanes.registry import LANES
        from dflash_queue.queue.stale_messages import drop_waiting

        drop_waiting(self.ledger.client, [spec.queue for spec in LANES.values()], recorded.fingerprint)

    def _stage_group(
        self, group: list[list[EncodedSample]], done: set[str], report: EnqueueReport, pool: ThreadPoolExecutor
    ) -> _StagedGroup:
        """Skip what is done or queued; start writing the prompt files of the rest."""
        shard_ids = [prompt_shard_id(shard) for shard in group]
        states = self.ledger.states(shard_ids)
        staged = _StagedGroup([len(shard) for shard in group], [], [])
        for shard_id, shard in zip(shard_ids, group):
            report.shards += 1
            report.shard_ids.append(shard_id)
            report.shard_samples[shard_id] = len(shard)
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
            for size in staged.sizes:
                on_shard(size)


def holds_output(storage: Storage) -> bool:
    """Whether `storage` holds anything a run made: completions, training shards (of any epoch, or the records of
    those consumed and deleted). Staged prompts and the run's record are not."""
    return holds_anything_made(storage)


def _send_generate(shard_id: str, num_samples: int, fingerprint: str) -> None:
    from dflash_queue.lanes.registry import FIRST_LANE
    from dflash_queue.queue.tasks import send_to_lane

    send_to_lane(FIRST_LANE.name, shard_id, num_samples, fingerprint)
