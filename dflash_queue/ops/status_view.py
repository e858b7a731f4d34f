"""The status snapshot as a rich table (one column per lane) and as JSON."""

from __future__ import annotations

from rich.console import Group
from rich.table import Table
from rich.text import Text

from dflash_queue.lanes.canary_notes import canary_summary
from dflash_queue.lanes.registry import LANES
from dflash_queue.ops import humanize
from dflash_queue.ops.audit_status import NAMED_SUSPECTS, AuditStatus
from dflash_queue.ops.live_status import LiveStatus
from dflash_queue.ops.status import LaneStatus, RunStatus
from dflash_queue.quality.gate import gate_summary


def status_table(status: RunStatus) -> Group:
    span = humanize.duration(status.window_span_s)
    title = f"run [bold]{status.run}[/bold] · broker {status.broker} · " + (
        f"throughput over the {span} before the inference servers went down" if status.servers_down
        else f"throughput over the last {span}"
    )
    table = Table(title=title, title_justify="left", show_lines=False)
    table.add_column("")
    for lane in status.lanes:
        table.add_column(lane, overflow="fold")
    rows = [
        ("workers alive", _workers),
        ("queue depth", lambda s: f"{s.queued:,}"),
        ("in flight", _in_flight),
        ("shards", lambda s: f"{s.shards_done:,} / {s.shards_total:,} done, {s.shards_failed} failed"),
        ("samples", lambda s: f"{s.samples_done:,} / {s.samples_total:,}"),
        ("tokens", _tokens),
        ("throughput", _throughput),
        ("turns", _turns),
        ("quality gate", _quality),
        ("canary", _canary),
        ("dead letters", lambda s: f"{s.dead_letters:,}"),
        ("ETA", _eta),
    ]
    for label, cell in rows:
        table.add_row(label, *(cell(lane) for lane in status.lanes.values()))
    notes = []
    if status.shards_missing:
        notes.append(
            Text(
                f"{len(status.shards_missing):,} shard(s) marked done have no training file in {status.storage} "
                f"(e.g. {status.shards_missing[0]}): `dflash-queue enqueue` sends them again",
                style="red",
            )
        )
    if status.storage_error:
        notes.append(Text(f"storage {status.storage} not checked ({status.storage_error}): done as the ledger says"))
    if status.live is not None:
        notes.extend(_live_lines(status.live))
    for stopped in status.stopped_workers:
        ago = humanize.duration(max(0.0, status.time - stopped.time))
        notes.append(
            Text(
                f"worker {stopped.node} ({stopped.lane}) stopped {ago} ago, exit status {stopped.exit_status}, not "
                f"restarted: {stopped.reason}",
                style="red",
            )
        )
    notes.extend(Text(waiting.describe(status.time), style="yellow") for waiting in status.servers_down)
    if status.audit is not None:
        notes.extend(_audit_lines(status.audit))
    if status.finished:
        footer = Text("run finished: every shard has passed every lane", style="green")
    elif status.live is not None and status.live.pending and all(
        lane.shards_total and not lane.shards_remaining for lane in status.lanes.values()
    ):
        footer = Text(f"every shard has passed every lane; training goes on: epoch {status.live.epoch} and after")
    elif status.audit is not None and status.audit.suspects and all(
        lane.shards_total and not lane.shards_remaining for lane in status.lanes.values()
    ):
        footer = Text(
            f"every shard has passed every lane; {len(status.audit.suspects):,} suspect shard(s) wait to be extracted "
            "again",
            style="red",
        )
    elif not any(lane.shards_total for lane in status.lanes.values()):
        footer = Text(f"nothing enqueued yet for run {status.run}")
    elif status.servers_down:
        since = min(wait.since for wait in status.servers_down)
        footer = Text(
            f"run ETA: waiting for servers (every inference server down for {humanize.duration(status.time - since)})",
            style="yellow",
        )
    else:
        footer = Text(f"run ETA (the slower lane): {humanize.duration(status.eta_s)}")
    return Group(table, *notes, footer)


def _eta(s: LaneStatus) -> str:
    if not s.shards_total:
        return "—"
    if s.shards_remaining == 0:
        return "done"
    if s.waiting_for_servers:
        return "waiting for servers"
    if s.eta_s is None:
        return "unknown (no progress in the window)"
    return humanize.duration(s.eta_s)


def _workers(s: LaneStatus) -> str:
    if not s.workers:
        return "0 (none answered)"
    return f"{len(s.workers)}: " + ", ".join(s.workers)


def _in_flight(s: LaneStatus) -> str:
    running = "?" if s.running is None else f"{s.running}"
    shown = f"{running} running, {s.reserved - s.held_by_dead} unacked"
    if s.held_by_dead:
        back = (
            f"back on the queue in {humanize.duration(s.held_back_in_s)}" if s.held_back_in_s is not None
            else "back once a worker starts"
        )
        shown += f"; {s.held_by_dead} stranded, held by a dead worker ({back})"
    return shown


def _tokens(s: LaneStatus) -> str:
    return _volume(s, s.totals, {"tokens": humanize.count, "bytes": humanize.size})


def _throughput(s: LaneStatus) -> str:
    return _volume(
        s, s.rates, {"tokens": lambda v: humanize.rate(v, "tok"), "bytes": lambda v: f"{humanize.size(v)}/s"}
    )


def _volume(s: LaneStatus, values: dict, formats: dict) -> str:
    parts = [f"{caption} {formats[unit](values[label])}".strip() for label, caption, unit in LANES[s.lane].volume]
    return " · ".join(parts)


def _shown(s: LaneStatus, row: str) -> bool:
    return row in LANES[s.lane].status_rows


def _quality(s: LaneStatus) -> str:
    if not s.quality:
        return "—"
    return "; ".join(gate_summary(s.quality))  # "28 kept, 2 flagged, 4 dropped, 0 retried; stub: 3 dropped; ..."


def _canary(s: LaneStatus) -> str:
    if LANES[s.lane].canary_error is None:
        return "—"
    summary = canary_summary(s.canary_samples, s.canary_worst_error, s.canary_untestable, s.canary_window)
    return summary or "no sample checked yet"


def _turns(s: LaneStatus) -> str:
    if not _shown(s, "turns"):
        return "—"
    reasons = {"stop": "stopped", "length": "truncated"}
    parts = [f"{reasons.get(k, k)} {v:,}" for k, v in s.finish_reasons.items()]
    return " · ".join(parts) or "none generated yet"


def _live_lines(live: LiveStatus) -> list[Text]:
    window = f"{live.window_fill} of {live.window_size} shards unconsumed" if live.window_size else "no window"
    lines = [
        Text(
            f"epoch {live.epoch}: {live.epoch_done:,} / {live.epoch_shards:,} shards extracted, {live.epoch_failed} "
            f"failed · window: {window}"
        )
    ]
    for c in live.consumers:
        ranks = ", ".join(f"{rank}: {humanize.duration(age)} ago" for rank, age in c.ranks_seen_s.items()) or "none yet"
        lines.append(
            Text(
                f"consumer {c.name} ({c.world_size} ranks): epoch {c.epoch}, {c.acknowledged:,} shards consumed, "
                f"{c.lag:,} behind · ranks last seen {ranks}",
                style="yellow" if c.silent_ranks else "",
            )
        )
    if not live.consumers:
        lines.append(Text("no consumer registered"))
    for name, what in live.to_go.items():
        lines.append(Text(f"training goes on: consumer {name}: {what}"))
    if live.waiting:
        lines.append(Text(live.waiting, style="yellow"))
    return lines


def _audit_lines(audit: AuditStatus) -> list[Text]:
    """The reference audit, a side lane (no progress or ETA), then the suspect shards it found."""
    workers = f"{len(audit.workers)} ({', '.join(audit.workers)})" if audit.workers else "0 (none answered)"
    running = "?" if audit.running is None else f"{audit.running}"
    lines = [
        Text(
            f"audit: workers {workers} · queue {audit.queued:,} · in flight {running} running, {audit.reserved} "
            f"unacked · {audit.shards:,} shards audited, {audit.samples:,} samples, "
            f"{humanize.count(audit.tokens)} tokens ({humanize.rate(audit.tokens_per_s, 'tok')}) · "
            f"{audit.failed:,} failed",
            style="red" if audit.failed else "",
        )
    ]
    if not audit.suspects:
        return lines
    named = "; ".join(f"{s.name}: {s.reason}" for s in audit.suspects[:NAMED_SUSPECTS])
    more = len(audit.suspects) - NAMED_SUSPECTS
    lines.append(
        Text(
            f"suspect shards: {len(audit.suspects):,}, not served as good until extracted again (`dflash-queue "
            f"suspects reextract`): {named}" + (f"; and {more:,} more (`dflash-queue suspects list`)" if more > 0 else ""),
            style="red",
        )
    )
    consumed = audit.consumed_suspects
    if consumed:
        named = "; ".join(f"{s.name} by {s.consumed()}" for s in consumed[:NAMED_SUSPECTS])
        more = len(consumed) - NAMED_SUSPECTS
        lines.append(
            Text(
                f"consumed before they turned suspect: {len(consumed):,} shard(s): {named}"
                + (f"; and {more:,} more" if more > 0 else ""),
                style="red",
            )
        )
    return lines
