"""Single-box run: a private broker if none is configured, one worker per lane, enqueue, wait (and stay up while a
trainer following the run has epochs to go), stop, summarise."""

from __future__ import annotations

import os
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from dflash_queue.broker.run_broker import forget_url, private_server, record_url
from dflash_queue.config import BROKER_URL_ENV, STORAGE_URL_ENV, Config
from dflash_queue.lanes.canary_notes import canary_summary
from dflash_queue.lanes.registry import AUDIT, FINAL_LANE, PIPELINE
from dflash_queue.producer import Producer
from dflash_queue.prompt_staging import EnqueueReport, checked_formatter
from dflash_queue.quality.gate import gate_summary
from dflash_queue.queue.app import configure_app
from dflash_queue.queue.child_guard import BROKER, WORKER, ChildGuard
from dflash_queue.queue.launcher import WorkerProcess
from dflash_queue.queue.maintenance import restore_unacked
from dflash_queue.queue.messages import messages_in
from dflash_queue.reextraction import check_reextraction, stage_reextraction
from dflash_queue.run_lock import RunLock
from dflash_queue.runstate.audits import AuditRecords
from dflash_queue.runstate.ledger import CANARY_ERROR, DONE, FAILED, Ledger
from dflash_queue.runstate.server_waits import OutageNotices, ServerWaits
from dflash_queue.runstate.window import ShardWindow
from dflash_queue.shards.keys import (
    Listable,
    consumed_location,
    consumed_shard_ids,
    run_shard_keys,
    shard_id_of,
    shards_location,
)
from dflash_queue.stop_signals import stopped_by_signals


class RunFailed(RuntimeError):
    pass


@dataclass
class RunSummary:
    report: EnqueueReport
    counters: dict[str, int]
    elapsed_s: float
    shards_done: int
    shards_failed: dict[str, str] = field(default_factory=dict)
    output: str = ""
    # The worst relative error of any canary sample (recomputed alone) in this run name, or None.
    canary_worst: float | None = None
    # Shards the ledger showed done whose training file is not in the run's storage.
    shards_missing: list[str] = field(default_factory=list)
    # Of the run's shards, those a reference audit made suspect, and why (not counted done).
    shards_suspect: dict[str, str] = field(default_factory=dict)
    audit_in_use: bool = False
    # Of the shards done, those a trainer following the run consumed and storage.retention = "until-consumed"
    # deleted: only their records (consumed/0/) are left.
    shards_consumed: int = 0
    consumed_records: str = ""

    def _output(self) -> str:
        if not self.shards_consumed:
            return self.output
        consumed = (
            f"{self.shards_consumed} consumed by training and deleted (storage.retention = \"until-consumed\"), "
            f"what each held recorded in {self.consumed_records}"
        )
        if self.shards_consumed >= self.shards_done:
            return f"none left in {self.output}: all {consumed}"
        return f"{self.output} ({consumed})"

    def _audit(self) -> str:
        c = self.counters
        if not c.get("audit_shards", 0):
            return "no shard audited" if self.audit_in_use else "off (audit.enabled = false)"
        failed = c.get("audit_failed", 0)
        return (
            f"{c['audit_shards']} shard(s) recomputed by the checkpoint's own forward ({c.get('audit_samples', 0)} "
            f"samples, {c.get('audit_tokens', 0)} tokens): "
            + (f"{failed} FAILED, {len(self.shards_suspect)} shard(s) suspect" if failed else "all agree")
        )

    def _canary(self) -> str:
        c = self.counters
        summary = canary_summary(c.get("extract_canary_samples", 0), self.canary_worst,
                                 c.get("extract_canary_untestable", 0), c.get("extract_canary_window", 0))
        return summary or "no sample rerun alone"

    def lines(self) -> list[str]:
        c = self.counters
        gate = gate_summary(c)
        lines = [
            f"samples:           {self.report.samples} read, {self.report.duplicates} duplicates, "
            f"{self.report.problems.total} bad records skipped, {self.report.too_long.total} too long skipped",
            f"shards:            {self.shards_done} done, {len(self.shards_failed)} failed, "
            + (f"{len(self.shards_missing)} missing from storage, " if self.shards_missing else "")
            + (f"{len(self.shards_suspect)} suspect, " if self.shards_suspect else "")
            + f"{self.report.skipped_done} were already done",
            f"tokens generated:  {c.get('generate_completion_tokens', 0)} "
            f"(prompts {c.get('generate_prompt_tokens', 0)}; "
            f"turns stopped {c.get('finish_stop', 0)}, truncated {c.get('finish_length', 0)})",
            f"quality gate:      {gate[0]}",
            *(f"                   {line}" for line in gate[1:]),
            f"tokens extracted:  {c.get('extract_tokens', 0)} ({c.get('extract_bytes', 0) / 1e6:.1f} MB)",
            f"canary:            {self._canary()}",
            f"audit:             {self._audit()}",
            f"elapsed:           {self.elapsed_s:.1f} s",
            f"training shards:   {self._output()}",
        ]
        if self.report.problems.total:
            lines.append("bad records:")
            lines.extend("  " + line for line in self.report.problems.lines())
        if self.report.too_long.total:
            lines.append("skipped as too long:")
            lines.extend("  " + line for line in self.report.too_long.lines())
        for shard_id, error in self.shards_failed.items():
            lines.append(f"failed shard {shard_id}: {error}")
        for shard_id, reason in self.shards_suspect.items():
            lines.append(f"suspect shard {shard_id}: {reason} (`dflash-queue suspects reextract` once fixed)")
        for shard_id in self.shards_missing:
            lines.append(
                f"missing shard {shard_id}: marked done, but {self.output}{shard_id}.safetensors does not exist"
            )
        return lines


def stop_workers(workers: list[WorkerProcess], console: Console, timeout: float) -> None:
    """Warm shutdown (running tasks finish); a second Ctrl-C (or SIGTERM, SIGHUP) kills them, and their tasks are
    requeued."""
    for worker in workers:
        worker.terminate()
    try:
        if any(worker.alive() for worker in workers):
            console.print("stopping workers: running tasks finish first (Ctrl-C, or the same signal, again stops at once)")
        for worker in workers:
            worker.stop(timeout=timeout)
    except KeyboardInterrupt:
        for worker in workers:
            worker.kill()
        raise


def _check_alive(workers: list[WorkerProcess]) -> None:
    for worker in workers:
        if not worker.alive():
            error = worker.error()
            raise RunFailed(
                f"the {worker.lane} worker exited with code {worker.process.returncode}"
                + (f": {error}" if error else "")
                + f"; log {worker.log_path}:\n{worker.log_tail()}"
            )


# After the last consumer is done, the run's broker stays up this long: a trainer's last calls (a place given back
# after its last acknowledgement) reach it.
CONSUMERS_GRACE_S = 3.0


def serve_consumers(
    consumption: ShardWindow, ledger: Ledger, workers: list[WorkerProcess], console: Console, poll_s: float
) -> None:
    """Once the job's shards are done, stay up (broker and workers) while a registered consumer still has epochs to
    go: its ranks start them, the extract worker extracts them, and they need the broker until they finish."""
    said = ""
    while to_go := consumption.to_go(ledger):
        now = "; ".join(f"consumer {name}: {what}" for name, what in to_go.items())
        if now != said:
            console.print(f"staying up for training ({now}); Ctrl-C stops, `run` again resumes")
            said = now
        _check_alive(workers)
        time.sleep(poll_s)
    if said:
        console.print("every consumer has trained its epochs")
        time.sleep(CONSUMERS_GRACE_S)


def run_single_box(
    config_path: Path,
    config: Config,
    datasets: list[Path],
    *,
    console: Console | None = None,
    poll_s: float = 0.5,
    rebuild: bool = False,
    reextract_from: Config | None = None,
    lock: RunLock | None = None,
) -> RunSummary:
    """`rebuild`: see `Producer.enqueue` (storage alone decides what is done; a run name made with another
    config is started over). `reextract_from`: instead of enqueueing `datasets`, extract that job's stored
    completions again with this config's extract settings (dflash_queue/reextraction.py): no generate worker.
    `lock`: the state directory's RunLock, already acquired by the caller (the CLI takes it before its heavy
    imports); released here once everything has stopped. Without it the run takes one itself.

    SIGINT, SIGTERM and SIGHUP stop it as Ctrl-C does (stop_signals.py): StopRequested is raised once the workers
    and the broker have stopped. Should this process die without stopping them (SIGKILL, a crash), a guard process
    stops them (queue/child_guard.py)."""
    with stopped_by_signals():
        return _run_single_box(config_path, config, datasets, console=console, poll_s=poll_s, rebuild=rebuild,
                               reextract_from=reextract_from, lock=lock)


def _run_single_box(
    config_path: Path,
    config: Config,
    datasets: list[Path],
    *,
    console: Console | None,
    poll_s: float,
    rebuild: bool,
    reextract_from: Config | None,
    lock: RunLock | None,
) -> RunSummary:
    if reextract_from is not None:
        check_reextraction(reextract_from, config)
    console = console or Console(stderr=True, soft_wrap=True)
    started = time.monotonic()
    # A thinking policy the template cannot honour stops the run before anything starts.
    formatter = checked_formatter(config.model, config.dataset, config.source)
    state_dir = Path(config.run.state_dir)
    with ExitStack() as stack:
        # One run per state directory, held until everything below has stopped (the broker last).
        if lock is None:
            lock = stack.enter_context(RunLock(state_dir, config.run.name))
        else:
            stack.callback(lock.release)
        # Closed after everything below has stopped; stops what is left running if this process dies first.
        guard = stack.enter_context(ChildGuard(state_dir / "logs" / "guard.log"))
        if lock.stopped_leftovers:
            console.print(
                f"took over {state_dir} from a run that was killed ({lock.previous.describe() if lock.previous else '?'}"
                f"); stopped what it left running: {', '.join(lock.stopped_leftovers)}"
            )
        if not config.broker.url:
            server = private_server(config.run, config.broker).start()
            stack.callback(server.stop)
            assert server.process is not None
            lock.record_child("redis-server", server.process.pid)
            guard.watch("redis-server", server.process.pid, role=BROKER)
            # status, dead and verify find it there while the run is up (and its data after: broker/run_broker.py)
            record_url(server.directory, server.url)
            stack.callback(forget_url, server.directory)
            config = config.with_overrides(broker={"url": server.url})
            console.print(f"started a private redis-server on {server.url} (AOF in {server.directory})")
            app = configure_app(config)
            # Nobody else consumes from a private broker: anything unacked belongs to workers of an earlier,
            # interrupted run. Put it back now rather than after the visibility timeout.
            restored = restore_unacked(app)
            if restored:
                console.print(f"requeued {restored} unfinished task(s) of an earlier run")
        else:
            configure_app(config)
        ledger = Ledger.from_url(config.broker.connection_url(), config.run.name)
        # A run name or storage made with other settings is refused before any worker loads a model.
        producer = Producer(config, ledger, formatter=formatter)
        producer.claim_run(rebuild=rebuild)
        if producer.took_over:
            console.print(producer.took_over)
        before = ledger.counters()

        env = {**os.environ, BROKER_URL_ENV: config.broker.url, STORAGE_URL_ENV: config.storage.url}
        lanes = [FINAL_LANE.name] if reextract_from is not None else [spec.name for spec in PIPELINE]
        if AUDIT.in_use(config):
            lanes.append(AUDIT.name)
        workers: list[WorkerProcess] = []
        stack.callback(stop_workers, workers, console, config.broker.task_timeout_s)
        for lane in lanes:
            workers.append(WorkerProcess(lane, config_path, env, state_dir / "logs" / f"{lane}.log"))
            lock.record_child(f"{lane} worker", workers[-1].pid)
            guard.watch(f"{lane} worker", workers[-1].pid, role=WORKER, warm_s=config.broker.task_timeout_s)
        console.print(f"started workers: {', '.join(f'{w.lane} (pid {w.process.pid})' for w in workers)}")

        progress = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
        )
        with progress:
            staging = progress.add_task("enqueue  (samples)", total=None)
            if reextract_from is not None:
                report = stage_reextraction(
                    reextract_from, config, ledger, producer.storage, on_shard=lambda n: progress.advance(staging, n)
                )
            else:
                report = producer.enqueue(datasets, on_shard=lambda n: progress.advance(staging, n), rebuild=rebuild)
            progress.update(staging, total=report.samples, completed=report.samples)
            pending = set(report.shard_ids)
            done_task = progress.add_task("complete (shards) ", total=len(pending))
            failed: dict[str, str] = {}
            # A generate worker whose every inference server is down waits: said when it begins and when it ends.
            outages = OutageNotices(ServerWaits(ledger.client, config.run.name))
            while True:
                states = ledger.states(pending)
                finished = {s for s, state in states.items() if state in (DONE, FAILED)}
                for line in outages.lines(time.time()):
                    progress.console.print(line)
                outage = " waiting for servers" if outages.waiting else ""
                progress.update(done_task, completed=len(finished), description=f"complete (shards) {outage}")
                if len(finished) == len(pending):
                    failed = {s: ledger.failure(s) for s, state in states.items() if state == FAILED}
                    for line in outages.over(time.time()):
                        progress.console.print(line)
                    break
                _check_alive(workers)
                time.sleep(poll_s)
            if AUDIT.in_use(config):
                auditing = progress.add_task("audit    (shards) ", total=None)
                while waiting := messages_in(ledger.client, AUDIT.queue):
                    progress.update(auditing, description=f"audit    ({waiting} shard(s) to go)")
                    _check_alive(workers)
                    time.sleep(poll_s)
                progress.update(auditing, description="audit    (done)  ", total=1, completed=1)
            serve_consumers(ShardWindow(ledger.client, config.run.name), ledger, workers, console, poll_s)

        after = ledger.counters()
        canary_worst = ledger.maxima().get(CANARY_ERROR)
        suspect = {s.shard: s.reason for s in AuditRecords(ledger.client, config.run.name).suspects()
                   if s.epoch == 0 and s.shard in pending}
        # Done is what storage holds, not what the ledger says.
        files, consumed = training_shards(producer.storage)
        stored = files | consumed
    delta = {name: after.get(name, 0) - before.get(name, 0) for name in after}
    missing = sorted(pending - stored - set(failed))
    return RunSummary(
        report=report,
        counters=delta,
        elapsed_s=time.monotonic() - started,
        shards_done=len((pending & stored) - set(suspect)),
        shards_failed=failed,
        shards_missing=missing,
        shards_suspect=suspect,
        audit_in_use=AUDIT.in_use(config),
        output=shards_location(config.storage.url),
        canary_worst=canary_worst,
        shards_consumed=len((pending & consumed) - files - set(suspect)),
        consumed_records=consumed_location(config.storage.url),
    )


def training_shards(storage: Listable) -> tuple[set[str], set[str]]:
    """Ids of the run's training shards in storage: (those whose file is there, those consumed by training and
    deleted, of which only a record is left)."""
    files = {shard_id_of(key) for key in run_shard_keys(storage)}
    return files, consumed_shard_ids(storage, 0) - files
