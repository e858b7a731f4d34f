"""Accounting for every sample of a dataset, by its id: done, flagged, dropped by the quality gate, filtered, or dead.

The dataset is read the way the producer reads it (same de-duplication, thinking policy and length filter), so
the samples to account for are those enqueue would stage from these files. What was enqueued is read from the
prompt shards in storage (shard id -> sample ids), so the files may be given in another order, or a subset or a
superset of those enqueued: a sample of a file never enqueued is reported as not enqueued. Every training shard
says which samples it holds and which the quality gate dropped (its header and offsets are read, and checked as
every reader checks them); dead letters name the samples that failed. A sample found nowhere is missing (with its
shard's ledger state); a sample found in two places is duplicated. A sample of a shard the reference audit found
suspect (its broker record or its mark in storage: dflash_queue/suspects.py) is not done: it is counted suspect,
its shard listed with the reason and the consumers it was served to as good, until it is extracted again.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from dflash_queue.config import BrokerConfig, Config, DatasetConfig, ModelConfig, RunConfig
from dflash_queue.data.length import LengthFilter
from dflash_queue.data.preparation import batched
from dflash_queue.deadletters import SAMPLE, TASK, DeadLetters
from dflash_queue.errors import ShardFormatError
from dflash_queue.lanes.registry import LANES
from dflash_queue.prompt_staging import EnqueueReport, build_length_filter, iter_encoded
from dflash_queue.queue.liveness import HeldMessage, Liveness
from dflash_queue.queue.messages import message_places
from dflash_queue.runstate.audits import AuditRecords
from dflash_queue.runstate.ledger import FAILED, Ledger
from dflash_queue.runstate.window import ShardWindow, epoch_states
from dflash_queue.shards.consumed import ConsumedShard
from dflash_queue.shards.keys import consumed_keys, epoch_shard_keys, prompts_keys, shard_id_of
from dflash_queue.shards.prompts import decode_prompts, prompt_shard_id
from dflash_queue.shards.ranges import open_source
from dflash_queue.shards.reader import ShardIndex
from dflash_queue.storage import Storage, open_storage
from dflash_queue.suspects import SuspectShard, find_suspects

# How many missing or duplicated ids a report lists in full.
LISTED = 50


@dataclass
class VerifyReport:
    epoch: int = 0
    staged: int = 0
    done: int = 0
    # Of the done: samples of shards every consumer took, deleted by storage.retention (their records remain).
    consumed: int = 0
    flagged: int = 0
    dropped: int = 0
    dead: int = 0
    # Samples of suspect shards: stored, not done until extracted again.
    suspect: int = 0
    # Accounted for before staging: exact duplicates of another record, too long for the context, unreadable.
    duplicates_in_dataset: int = 0
    too_long: int = 0
    bad_records: int = 0
    # sample id -> its shard and that shard's ledger state (queued, generated, failed, or unknown).
    missing: dict[str, str] = field(default_factory=dict)
    # sample id -> every place it was found.
    duplicated: dict[str, list[str]] = field(default_factory=dict)
    unreadable_shards: dict[str, str] = field(default_factory=dict)
    # The epoch's suspect shards (dflash_queue/suspects.py), oldest first.
    suspect_shards: list[SuspectShard] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.duplicated and not self.unreadable_shards and not self.suspect_shards

    def lines(self) -> list[str]:
        out = [
            f"staged samples: {self.staged}" + (f" (epoch {self.epoch})" if self.epoch else ""),
            f"  done: {self.done} (of which flagged by the quality gate: {self.flagged}"
            + (f"; consumed and deleted: {self.consumed}" if self.consumed else "")
            + ")",
            f"  dropped by the quality gate: {self.dropped}",
            f"  dead letters: {self.dead}",
            *([f"  suspect (stored, not done until extracted again): {self.suspect}"] if self.suspect_shards else []),
            f"  missing: {len(self.missing)}",
            f"  duplicated: {len(self.duplicated)}",
            f"filtered before staging: {self.duplicates_in_dataset} exact duplicates, {self.too_long} too long, "
            f"{self.bad_records} bad records",
        ]
        out += [f"note: {note}" for note in self.notes]
        for key, error in self.unreadable_shards.items():
            out.append(f"unreadable shard {key}: {error}")
        for suspect in self.suspect_shards[:LISTED]:
            out.append(f"suspect shard {suspect.name}: {suspect.describe()}")
        consumed = [s for s in self.suspect_shards if s.consumed_by]
        for suspect in consumed[:LISTED]:
            out.append(
                f"consumed before it turned suspect: {suspect.name} by {suspect.consumed()} (trained on states that "
                "may not be the model's)"
            )
        if self.suspect_shards:
            out.append(
                f"{len(self.suspect_shards)} suspect shard(s) ({len(consumed)} consumed before they turned suspect): "
                "`dflash-queue suspects reextract -c CONFIG` extracts them again"
            )
        for sample_id, where in list(self.missing.items())[:LISTED]:
            out.append(f"missing {sample_id}: {where}")
        for sample_id, places in list(self.duplicated.items())[:LISTED]:
            out.append(f"duplicated {sample_id}: {', '.join(places)}")
        return out


def found_in(
    found: dict[str, list[str]],
    flagged_ids: set[str],
    where: str,
    ids: Iterable[str],
    flagged: Iterable[str],
    dropped: Iterable[str],
) -> None:
    for sample_id in ids:
        found[sample_id].append(where)
    flagged_ids.update(flagged)
    for sample_id in dropped:
        found[sample_id].append(f"{where} (dropped)")


@dataclass(frozen=True)
class MissingHints:
    """What will bring a missing shard back, from where its message is (a queue, a worker, a dead worker, nowhere)."""

    places: dict[str, str]
    held_by_dead: dict[str, HeldMessage]

    @classmethod
    def read(cls, client, run: RunConfig, broker: BrokerConfig) -> MissingHints:
        dead = Liveness(client, run.name, broker.worker_liveness_s).held_by_dead()
        return cls(message_places(client, [spec.queue for spec in LANES.values()]), {m.shard_id: m for m in dead})

    def why(self, shard_id: str, state: str, epoch: int) -> str:
        held = self.held_by_dead.get(shard_id)
        if held is not None:
            back_in = max(0, round(held.back_by() - time.time()))
            return (
                f"its {held.queue} task is held by {held.node}, a worker whose heartbeat stopped: a live worker puts "
                f"it back on the queue within {back_in} s"
            )
        if shard_id in self.places:
            return f"{self.places[shard_id]}: done when that lane's workers get to it"
        if state == FAILED:
            return "failed and its dead letter purged: `dflash-queue enqueue` sends it again"
        if epoch:
            return "no message for it in the broker: `dflash-queue epoch --resend` sends it again"
        return "no message for it in the broker: `dflash-queue enqueue --rebuild` sends it again"


def expected_shards(
    dataset: DatasetConfig,
    model: ModelConfig,
    datasets: Iterable[str | Path],
    report: VerifyReport,
    length_filter: LengthFilter | None,
) -> dict[str, list[str]]:
    """shard id -> sample ids, exactly as the producer stages them (`length_filter`: build_length_filter's)."""
    enqueue = EnqueueReport()
    samples = iter_encoded(dataset, model, datasets, enqueue, length_filter)
    shards = {prompt_shard_id(group): [s.id for s in group] for group in batched(samples, dataset.shard_size)}
    report.staged = enqueue.staged
    report.duplicates_in_dataset = enqueue.duplicates
    report.too_long = enqueue.too_long.total
    report.bad_records = enqueue.problems.total
    return shards


def shard_contents(storage: Storage, key: str) -> tuple[list[str], list[int], list[str]]:
    """(sample ids, indices of flagged samples, ids dropped by the quality gate) from a shard's header, read and
    checked by the shards' one reader. A sample stored as one sequence per turn has several rows: it is one
    sample."""
    source = open_source(storage, key)
    try:
        index = ShardIndex.load(source)
    finally:
        source.close()
    first_rows = {sample_id: row for row, sample_id in reversed(list(enumerate(index.sample_ids)))}
    ids = list(first_rows)
    flagged = [row for row in first_rows.values() if index.quality_flags[row]]
    dropped = [entry["id"] for entry in index.dropped]
    return ids, flagged, dropped


def enqueued_shards(storage: Storage) -> dict[str, list[str]]:
    """shard id -> sample ids, from the prompt shards in storage: what was enqueued, whatever file list it came
    from."""
    shards = {}
    for key in prompts_keys(storage):
        shards[shard_id_of(key)] = [s.id for s in decode_prompts(storage.read_bytes(key), what=key)]
    return shards


def verify(
    config: Config,
    datasets: Iterable[str | Path],
    *,
    storage: Storage | None = None,
    ledger: Ledger | None = None,
    dead_letters: DeadLetters | None = None,
    epoch: int = 0,
) -> VerifyReport:
    """Account for every sample of `datasets` by its id: the files may be any order or subset of those enqueued
    (samples of files never enqueued are reported as not enqueued). `epoch`: the run's training shards (0), or
    a later epoch's, extracted again for a live dataset; a shard every consumer took and retention deleted is
    accounted for by the record it left (`consumed`). Takes the whole Config: it reads the run's storage, broker
    and ledger, and stages the datasets again as the producer did."""
    report = VerifyReport(epoch=epoch)
    storage = storage or open_storage(config.storage)
    if ledger is None or dead_letters is None:
        broker_url = config.broker.connection_url()  # reads the password file
        ledger = ledger or Ledger.from_url(broker_url, config.run.name)
        dead_letters = dead_letters or DeadLetters.from_url(broker_url, config.run.name)
    expected = expected_shards(config.dataset, config.model, datasets, report, build_length_filter(config))
    enqueued = enqueued_shards(storage)
    shard_of = {sample_id: shard_id for shard_id, ids in enqueued.items() for sample_id in ids}
    regrouped = len(expected.keys() - enqueued.keys())
    if regrouped:
        report.notes.append(
            f"the files as given make {regrouped} of {len(expected)} shards that were never enqueued (another file "
            "list or order than enqueue was given): samples are accounted for by id"
        )
    found: dict[str, list[str]] = defaultdict(list)
    flagged_ids: set[str] = set()

    report.suspect_shards = find_suspects(AuditRecords(ledger.client, config.run.name), storage, epoch=epoch)
    suspect_ids = {s.shard for s in report.suspect_shards}
    # Where samples of suspect shards were found: counted suspect there, not done.
    suspect_places: set[str] = set()
    stored_ids: set[str] = set()
    for key in epoch_shard_keys(storage, epoch):
        stored_ids.add(shard_id_of(key))
        try:
            ids, flagged, dropped = shard_contents(storage, key)
        except Exception as exc:  # a corrupt or truncated shard is reported, the rest still checked
            report.unreadable_shards[key] = f"{type(exc).__name__}: {exc}"
            continue
        if shard_id_of(key) in suspect_ids:
            suspect_places.add(key)
        found_in(found, flagged_ids, key, ids, [ids[row] for row in flagged], dropped)
    for key in consumed_keys(storage, epoch):
        if shard_id_of(key) in stored_ids:
            continue  # deleted after its record was written, or about to be: the file counts
        try:
            consumed = ConsumedShard.from_json(storage.read_bytes(key), where=key)
        except ShardFormatError as exc:
            report.unreadable_shards[key] = str(exc)
            continue
        if shard_id_of(key) in suspect_ids:
            suspect_places.add(f"{key} (consumed)")
        else:
            report.consumed += len(consumed.samples)
        found_in(found, flagged_ids, f"{key} (consumed)", consumed.samples, consumed.flagged, consumed.dropped)

    for record in dead_letters.all():
        if int(record.kwargs.get("epoch", 0) or 0) > epoch:
            continue  # a later epoch's failure: this epoch's copy is elsewhere
        sample_ids = record.sample_ids
        if not sample_ids and record.kind in (TASK, SAMPLE):
            sample_ids = enqueued.get(record.shard_id) or expected.get(record.shard_id, [])
        for sample_id in sample_ids:
            found[sample_id].append(f"dead letter {record.id}")

    shard_ids = sorted(set(shard_of.values()))
    states = epoch_states(ShardWindow(ledger.client, config.run.name), ledger, epoch, shard_ids)
    hints: MissingHints | None = None
    for sample_id in (i for ids in expected.values() for i in ids):
        places = found.get(sample_id, [])
        if not places:
            shard_id = shard_of.get(sample_id)
            if shard_id is None:
                report.missing[sample_id] = "not enqueued"
                continue
            hints = hints or MissingHints.read(ledger.client, config.run, config.broker)
            state = states.get(shard_id, "unknown")
            report.missing[sample_id] = f"shard {shard_id} ({state}; {hints.why(shard_id, state, epoch)})"
            continue
        if len(places) > 1:
            report.duplicated[sample_id] = places
        where = places[0]
        if where.startswith("dead letter"):
            report.dead += 1
        elif where.endswith("(dropped)"):
            report.dropped += 1
        elif where in suspect_places:
            report.suspect += 1
        else:
            report.done += 1
            report.flagged += sample_id in flagged_ids
    return report
