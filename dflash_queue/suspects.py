"""Shards the reference audit found suspect, as an operator sees them (`dflash-queue suspects list`, `status`,
`verify`), and their re-extraction (`dflash-queue suspects reextract`).

A suspect shard has two records: the broker's (runstate/audits.py: who stored it, the failed audit, who had
consumed it by then) and its mark in storage (shards/suspects.py), which readers without the broker check. Either
makes it suspect here; one without the other is said so (a mark the audit lane had not written yet, or a broker
that was lost).

Re-extraction sends each suspect shard to the extract lane again with `redo` (its epoch's shard, computed anew from
its stored completions, never the stored file skipped), sets its state back to the extract lane's waiting state
(the ledger's for epoch 0, its epoch's otherwise) so that `status` and `verify` show it pending, and leaves both
marks: the extract lane removes them once the new shard is stored. A shard whose completions are gone cannot be
extracted again and is refused, named.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash_queue.lanes.registry import FINAL_LANE
from dflash_queue.runstate.audits import AuditRecords, Suspect
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.runstate.window import ShardWindow
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key, suspect_key, suspect_mark_of, suspect_marks_prefix
from dflash_queue.shards.suspects import SuspectMark
from dflash_queue.storage.base import Storage

# send(shard id, samples, fingerprint, epoch): an extract task with redo, for the shard of that epoch.
SendRedo = Callable[[str, int, str, int], None]

SENT, WOULD_SEND, ALREADY_SENT, REFUSED = "sent", "would send", "already sent", "refused"


@dataclass(frozen=True)
class SuspectShard:
    shard: str
    epoch: int
    reason: str  # what the failed audit found
    node: str  # the extract worker that stored it
    audited: str = ""  # the shard whose audit failed ("" when its worker had been halted before it stored this one)
    incarnation: str = ""  # the worker process that stored it (the broker's record only)
    time: float = 0.0  # when it turned suspect
    # Consumers that had acknowledged it when it turned suspect (or later): trainers it was served to as good.
    consumed_by: tuple[str, ...] = ()
    in_broker: bool = True  # the broker records it
    marked: bool | None = None  # storage holds its mark (None: storage not looked at)

    @property
    def name(self) -> str:
        return f"{self.shard} (epoch {self.epoch})" if self.epoch else self.shard

    def describe(self) -> str:
        found = f"the audit of shard {self.audited} failed" if self.audited else "its worker had been halted by an audit"
        text = f"stored by {self.node or '?'}; {found}: {self.reason}"
        if self.marked is False:
            text += " (no mark in storage: readers without the broker do not know it is suspect)"
        elif not self.in_broker:
            text += " (marked in storage only: the broker has no record of it)"
        return text

    def consumed(self) -> str:
        """Who was served it as good, or ""."""
        return ", ".join(self.consumed_by)

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "consumed_by": list(self.consumed_by)}


def _of_record(suspect: Suspect) -> SuspectShard:
    return SuspectShard(
        shard=suspect.shard, epoch=suspect.epoch, reason=suspect.reason, node=suspect.node, audited=suspect.audited,
        incarnation=suspect.incarnation, time=suspect.time, consumed_by=tuple(suspect.consumed_by),
    )


def _of_mark(mark: SuspectMark) -> SuspectShard:
    return SuspectShard(
        shard=mark.shard_id, epoch=mark.epoch, reason=mark.reason, node=mark.node, audited=mark.audited,
        time=mark.time, in_broker=False, marked=True,
    )


def marked_shards(storage: Storage) -> set[tuple[int, str]]:
    """(epoch, shard id) of every suspect mark in the run's storage (one listing)."""
    found = set()
    for key in storage.list(suspect_marks_prefix()):
        if (mark := suspect_mark_of(key)) is not None:
            found.add(mark)
    return found


def find_suspects(
    records: AuditRecords, storage: Storage | None = None, *, epoch: int | None = None
) -> list[SuspectShard]:
    """Every suspect shard (of `epoch`, or of all), oldest first: the broker's records, and with `storage` the
    marks in it (each record then says whether its mark is there, and a mark without a record is read)."""
    shards = {(s.epoch, s.shard): _of_record(s) for s in records.suspects() if epoch is None or s.epoch == epoch}
    if storage is not None:
        marks = {place for place in marked_shards(storage) if epoch is None or place[0] == epoch}
        for place, shard in list(shards.items()):
            shards[place] = SuspectShard(**{**asdict(shard), "marked": place in marks})
        for mark_epoch, shard_id in sorted(marks - shards.keys()):
            key = suspect_key(shard_id, mark_epoch)
            try:
                mark = SuspectMark.from_json(storage.read_bytes(key), where=key)
            except FileNotFoundError:
                continue  # removed since it was listed: stored anew
            except Exception as exc:  # an unreadable mark still makes its shard suspect
                mark = SuspectMark(shard_id, mark_epoch, f"unreadable mark {key}: {exc}", "", "?")
            shards[(mark_epoch, shard_id)] = _of_mark(mark)
    return sorted(shards.values(), key=lambda s: (s.time, s.epoch, s.shard))


@dataclass(frozen=True)
class ReextractOutcome:
    shard: str
    epoch: int
    action: str  # SENT, WOULD_SEND, ALREADY_SENT or REFUSED
    detail: str
    samples: int = 0

    def line(self) -> str:
        name = f"{self.shard} (epoch {self.epoch})" if self.epoch else self.shard
        return f"{self.action}: {name}: {self.detail}"


@dataclass
class Reextraction:
    outcomes: list[ReextractOutcome] = field(default_factory=list)

    @property
    def refused(self) -> list[ReextractOutcome]:
        return [o for o in self.outcomes if o.action == REFUSED]

    def lines(self) -> list[str]:
        out = [o.line() for o in self.outcomes]
        counts = {action: sum(o.action == action for o in self.outcomes) for action in
                  (SENT, WOULD_SEND, ALREADY_SENT, REFUSED)}
        out.append(", ".join(f"{n} {action}" for action, n in counts.items() if n) or "no suspect shard")
        return out


def reextract(
    run_name: str,
    fingerprint: str,
    suspects: Iterable[SuspectShard],
    *,
    ledger: Ledger,
    storage: Storage,
    send: SendRedo,
    resend: bool = False,
    dry_run: bool = False,
) -> Reextraction:
    """Send each suspect shard to the extract lane again (`redo`, its epoch), with `fingerprint` (the run's
    Config.fingerprint()), its state set back to the extract lane's waiting state first. A shard already waiting
    there (sent before, not yet stored) is not sent again unless `resend`; one whose completions are missing is
    refused. `dry_run`: say what would be sent."""
    report = Reextraction()
    window = ShardWindow(ledger.client, run_name)
    waiting = FINAL_LANE.waiting_state
    task = f"{FINAL_LANE.task_name} on queue {FINAL_LANE.queue}"
    for suspect in suspects:
        shard_id, epoch = suspect.shard, suspect.epoch
        key = completions_key(shard_id)
        if not storage.exists(key):
            report.outcomes.append(ReextractOutcome(
                shard_id, epoch, REFUSED,
                f"its completions ({key}) are not in {storage.url}: nothing to extract it again from; delete its "
                "training shard and run `dflash-queue enqueue --rebuild` to generate and extract it anew",
            ))
            continue
        samples = sum(record.kept for record in decode_completions(storage.read_bytes(key), what=key))
        state = (ledger.states([shard_id]) if epoch == 0 else window.epoch_states(epoch)).get(shard_id)
        if state == waiting and not resend:
            report.outcomes.append(ReextractOutcome(
                shard_id, epoch, ALREADY_SENT,
                f"waiting in the extract lane (state {state}) since an earlier re-extraction; --resend sends it again",
                samples,
            ))
            continue
        what = f"{task}, redo{f', epoch {epoch}' if epoch else ''}, {samples} samples (was {state or 'unknown'})"
        if dry_run:
            report.outcomes.append(ReextractOutcome(shard_id, epoch, WOULD_SEND, what, samples))
            continue
        _set_state(ledger, window, shard_id, epoch, waiting)
        try:
            send(shard_id, samples, fingerprint, epoch)
        except BaseException:
            if state is not None:
                _set_state(ledger, window, shard_id, epoch, state)
            raise
        report.outcomes.append(ReextractOutcome(shard_id, epoch, SENT, what, samples))
    return report


def _set_state(ledger: Ledger, window: ShardWindow, shard_id: str, epoch: int, state: str) -> None:
    if epoch:
        window.set_epoch_state(epoch, shard_id, state)
    else:
        ledger.set_state(shard_id, state)
