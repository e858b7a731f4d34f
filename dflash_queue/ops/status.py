"""Where a run stands, per lane: queues, workers, progress, throughput over a recent window, and an ETA.

Everything comes from Redis (the ledger's counters and shard states, the broker's queues and unacked
messages) plus one control broadcast to the workers, so it works from any machine that reaches the broker and
survives worker restarts. Dead letters are counted per lane from their records (dflash_queue.deadletters).
A shard counts as extracted only when its training file is listed in the configured storage: one the ledger
shows done without it is reported missing (`shards_missing`), never done. Workers that stopped themselves because
their engine kept failing its state checks are listed with the reason (`stopped_workers`,
dflash_queue/runstate/stopped_workers.py) until a worker of the same name starts again. The reference audit, a side
lane, has a section of its own when it is in use (ops/audit_status.py): its queue, workers and figures, and the
suspect shards (the broker's records), which keep the run from being finished until they are extracted again.

While a generate worker waits because every inference server it was given is down (runstate/server_waits.py), no
lane has an ETA: each lane with work left shows it waits for the servers, since every lane downstream of generate
starves with it. The throughput window leaves the outage out (its span ends where the outage began), so the rates
shown are those of the work before it, not diluted by the pause. Once the servers are back, the pause stays in the
window until it slides out of it.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, replace

import redis
from kombu.transport.redis import Channel

from dflash_queue.config import Config, StorageConfig
from dflash_queue.deadletters import DeadLetters
from dflash_queue.lanes.registry import FINAL_LANE, FIRST_LANE, LANES, PIPELINE, LaneSpec, lane_of_task
from dflash_queue.ops.audit_status import AuditStatus, audit_in_use, collect_audit
from dflash_queue.ops.live_status import LiveStatus, collect_live
from dflash_queue.queue.liveness import Liveness
from dflash_queue.queue.messages import queue_lists
from dflash_queue.redaction import redact
from dflash_queue.runstate.audits import AuditRecords
from dflash_queue.runstate.ledger import DONE, FAILED, Ledger, WindowTotals
from dflash_queue.runstate.redis_connect import redis_client
from dflash_queue.runstate.server_waits import ServersDown, ServerWaits
from dflash_queue.runstate.stopped_workers import StoppedWorker, StoppedWorkers
from dflash_queue.shards.keys import stored_shard_ids
from dflash_queue.storage import open_storage
from dflash_queue.suspects import find_suspects

# The quality gate's counters: `gate_{decision}` per sample and `gate_{check}_{action}` per failed check.
QUALITY_PREFIX = "gate_"
DEFAULT_WINDOW_S = 600

def dead_letters_per_lane(client: redis.Redis, run_name: str) -> dict[str, int]:
    per_lane = Counter(record.lane for record in DeadLetters(client, run_name).all())
    return {name: per_lane.get(name, 0) for name in LANES}


@dataclass
class LaneStatus:
    lane: str
    queued: int  # messages waiting in the lane's queue
    reserved: int  # delivered to a worker and not yet acknowledged: running or prefetched
    running: int | None  # tasks the lane's workers report running; None when no worker answered
    workers: list[str]
    shards_total: int
    shards_done: int
    shards_failed: int  # failed in this lane
    shards_remaining: int  # still to pass through this lane
    samples_total: int
    samples_done: int
    totals: dict[str, int]  # the lane's counters (LaneSpec.counters) by label
    rates: dict[str, float]  # the same labels, per second over the window
    quality: dict[str, int] = field(default_factory=dict)
    quality_dropped: int = 0
    # Generated turns by finish reason (`finish_stop`, `finish_length`), every turn counted; empty for a lane
    # that generates nothing.
    finish_reasons: dict[str, int] = field(default_factory=dict)
    dead_letters: int = 0
    eta_s: float | None = None
    # Messages held by dead workers (killed, lost with their node: heartbeat stopped or process gone), counted in
    # `reserved` but not moving, and in how many seconds at most a live worker puts them back on the queue (None
    # while no worker is alive to do it).
    held_by_dead: int = 0
    held_back_in_s: float | None = None
    # Samples recomputed alone by the canary, and the worst relative error any of them showed (a lane that
    # checks its states).
    canary_samples: int = 0
    canary_worst_error: float | None = None
    # Shards whose canary could not see a leak between sequences (no sample followed another in its pass), and
    # shards whose canary checked a sequence longer than the model's window.
    canary_untestable: int = 0
    canary_window: int = 0
    # Work is left and a generate worker waits for its inference servers: no ETA (eta_s is None).
    waiting_for_servers: bool = False


@dataclass
class RunStatus:
    run: str
    broker: str
    time: float
    window_s: float
    window_span_s: float
    lanes: dict[str, LaneStatus]
    eta_s: float | None
    finished: bool
    storage: str = ""
    # Shards the ledger shows done whose training file is not in `storage`.
    shards_missing: list[str] = field(default_factory=list)
    # Why storage could not be listed (then done is the ledger's word, unverified).
    storage_error: str | None = None
    # A run trained while it extracts: epoch, window, consumers (None when none of it applies).
    live: LiveStatus | None = None
    # Workers that stopped because their engine failed its state checks on shard after shard, oldest first.
    stopped_workers: list[StoppedWorker] = field(default_factory=list)
    # Generate workers waiting because every inference server they were given is down.
    servers_down: list[ServersDown] = field(default_factory=list)
    # The reference audit (a side lane) and the suspect shards it found; None when it is not in use and none is.
    audit: AuditStatus | None = None

    def to_json(self) -> dict:
        return asdict(self)


def queue_depth(client: redis.Redis, queue: str) -> int:
    """Messages waiting in a kombu Redis queue, over all its priority sub-queues."""
    pipe = client.pipeline(transaction=False)
    for name in queue_lists(queue):
        pipe.llen(name)
    return sum(pipe.execute())


def unacked_by_queue(client: redis.Redis) -> dict[str, int]:
    """Delivered, unacknowledged messages per routing key (= queue here), from kombu's `unacked` hash."""
    counts: dict[str, int] = {}
    for raw in client.hvals(Channel.unacked_key):
        try:
            routing_key = json.loads(raw)[2]
        except (ValueError, IndexError, TypeError):
            continue
        counts[routing_key] = counts.get(routing_key, 0) + 1
    return counts


@dataclass
class WorkerView:
    """What the workers said to a control broadcast: node -> queues it consumes, node -> running tasks."""

    queues: dict[str, list[str]] = field(default_factory=dict)
    running: dict[str, int] = field(default_factory=dict)

    def lane_workers(self, queue: str) -> list[str]:
        return sorted(node for node, queues in self.queues.items() if queue in queues)

    def lane_running(self, queue: str) -> int | None:
        nodes = self.lane_workers(queue)
        if not nodes:
            return None
        return sum(self.running.get(node, 0) for node in nodes)


def ask_workers(app, timeout: float) -> WorkerView:
    # The replies are read on a connection of its own, closed after: from the app's pool, a connection stays
    # behind with a channel in the middle of a blocking read of the reply queue, and a process forked later (a
    # DataLoader's workers) hangs in kombu's after-fork cleanup, closing that channel on the inherited socket.
    with app.connection_for_read() as connection:
        inspect = app.control.inspect(timeout=timeout, connection=connection)
        queues = inspect.active_queues() or {}
        nodes = list(queues)
        active = (
            (app.control.inspect(timeout=timeout, destination=nodes, connection=connection).active() or {})
            if nodes
            else {}
        )
    return WorkerView(
        queues={node: [q["name"] for q in qs or []] for node, qs in queues.items()},
        running={node: len(tasks or []) for node, tasks in active.items()},
    )


def collect_status(
    config: Config,
    *,
    window_s: float = DEFAULT_WINDOW_S,
    workers: WorkerView | None = None,
    inspect_timeout: float = 1.0,
    now: float | None = None,
) -> RunStatus:
    """A snapshot of the run. `workers` skips the control broadcast (given by a caller that already asked). Takes
    the whole Config: it reads the run, broker, storage and extract sections and configures the Celery app from it."""
    now = time.time() if now is None else now
    # Redis first: an unreachable broker fails here, fast, instead of inside a control broadcast that retries.
    client = redis_client(config.broker.connection_url(), decode_responses=True, socket_connect_timeout=5)
    try:
        ledger = Ledger(client, config.run.name)
        counters = ledger.counters()
        maxima = ledger.maxima()
        window = ledger.window(window_s, now=now)
        states = ledger.states()
        sizes = ledger.shard_sizes()
        failures = ledger.failures()
        unacked = unacked_by_queue(client)
        dead = dead_letters_per_lane(client, config.run.name)
        depths = {name: queue_depth(client, spec.queue) for name, spec in LANES.items()}
        live = collect_live(client, config.run.name, config.extract.max_unconsumed_shards, now=now)
        liveness = Liveness(client, config.run.name, config.broker.worker_liveness_s)
        held = liveness.held_by_dead()
        # Only a live worker puts back what a dead one held: with none, nothing says when that work moves again.
        someone_beats = liveness.any_alive()
        stopped = StoppedWorkers(client, config.run.name).all()
        servers_down = ServerWaits(client, config.run.name).all()
        suspects = find_suspects(AuditRecords(client, config.run.name))
    finally:
        client.close()
    window = without_outage(window, servers_down, now)
    stored, storage_error = stored_shards(config.storage)
    missing = sorted(s for s, st in states.items() if st == DONE and s not in stored) if stored is not None else []
    if workers is None:
        from dflash_queue.queue.app import configure_app

        workers = ask_workers(configure_app(config), inspect_timeout)

    lanes = {}
    for spec in PIPELINE:
        name = spec.name
        failed = [s for s, st in states.items() if st == FAILED and _failed_in(failures.get(s, ""), spec)]
        done = [s for s, st in states.items() if st in spec.done_states]
        if spec is FINAL_LANE:  # its output is the training shard: done means stored
            done = [s for s in done if s not in missing]
        pending = [s for s, st in states.items() if st in spec.pending_states]
        status = LaneStatus(
            lane=name,
            queued=depths[name],
            reserved=unacked.get(spec.queue, 0),
            running=workers.lane_running(spec.queue),
            workers=workers.lane_workers(spec.queue),
            shards_total=len(states),
            shards_done=len(done),
            shards_failed=len(failed),
            shards_remaining=len(pending),
            samples_total=sum(sizes.values()),
            samples_done=sum(sizes.get(s, 0) for s in done),
            totals={label: counters.get(counter, 0) for counter, label in spec.counters},
            rates={label: window.rate(counter) for counter, label in spec.counters},
            dead_letters=int(dead.get(name, 0)),
        )
        if "quality gate" in spec.status_rows:
            status.quality = {k: v for k, v in sorted(counters.items()) if k.startswith(QUALITY_PREFIX)}
            status.quality_dropped = counters.get("gate_drop", 0)
        if "turns" in spec.status_rows:
            status.finish_reasons = {
                k.removeprefix("finish_"): v for k, v in sorted(counters.items()) if k.startswith("finish_")
            }
        if spec.canary_error is not None:
            status.canary_samples = counters.get(spec.canary_counter, 0)
            status.canary_worst_error = maxima.get(spec.canary_error)
            status.canary_untestable = counters.get(f"{spec.name}_canary_untestable", 0)
            status.canary_window = counters.get(f"{spec.name}_canary_window", 0)
        # Shards, not samples, measure what is left: the quality gate may shrink a shard on its way.
        shard_rate = window.rate(spec.shards_counter)
        if not states:
            status.eta_s = None
        elif not pending:
            status.eta_s = 0.0
        elif shard_rate > 0:
            status.eta_s = len(pending) / shard_rate
        dead_held = [m for m in held if m.queue == spec.queue]
        if dead_held:
            # Held work is not moving: it waits until a live worker puts it back, then for a worker to do it. No
            # ETA says less, and none is given while no worker lives to put it back.
            status.held_by_dead = len(dead_held)
            if someone_beats:
                status.held_back_in_s = max(0.0, max(m.back_by() for m in dead_held) - now)
            if status.held_back_in_s is None or shard_rate <= 0:
                status.eta_s = None
            elif status.eta_s is not None:
                status.eta_s = max(status.eta_s, status.held_back_in_s + len(dead_held) / shard_rate)
        if servers_down and pending:
            status.waiting_for_servers = True
            status.eta_s = None
        lanes[name] = status

    audit_spec = LANES["audit"]
    audit = collect_audit(
        suspects,
        counters=counters,
        window=window,
        queued=depths[audit_spec.name],
        reserved=unacked.get(audit_spec.queue, 0),
        workers=workers.lane_workers(audit_spec.queue),
        running=workers.lane_running(audit_spec.queue),
        in_use=audit_in_use(config, counters),
    )

    etas = [lane.eta_s for lane in lanes.values()] if states else [None]
    finished = bool(states) and not missing and all(lane.shards_remaining == 0 for lane in lanes.values())
    finished = finished and not (live is not None and live.pending)
    finished = finished and not suspects
    return RunStatus(
        run=config.run.name,
        broker=redact(config.broker.url),
        time=now,
        window_s=window_s,
        window_span_s=window.span_s,
        lanes=lanes,
        # The run ends when its slower lane does; unknown while either lane has no measured rate.
        eta_s=None if any(eta is None for eta in etas) else max(eta for eta in etas if eta is not None),
        finished=finished,
        storage=redact(config.storage.url),
        shards_missing=missing,
        storage_error=storage_error,
        live=live,
        stopped_workers=stopped,
        servers_down=servers_down,
        audit=audit,
    )


def without_outage(window: WindowTotals, servers_down: list[ServersDown], now: float) -> WindowTotals:
    """The window cut where the current outage began: nothing can move while every server is down, so the pause
    says nothing of the rate."""
    if not servers_down:
        return window
    down_s = now - min(wait.since for wait in servers_down)
    return replace(window, span_s=max(0.0, window.span_s - max(0.0, down_s)))


def stored_shards(settings: StorageConfig) -> tuple[set[str] | None, str | None]:
    """Ids of the training shards in the configured storage, or (None, why) when it cannot be listed."""
    try:
        storage = open_storage(settings)
        try:
            return stored_shard_ids(storage), None
        finally:
            if hasattr(storage, "close"):
                storage.close()
    except Exception as exc:  # status must show what it can; the reason is displayed instead of the check
        return None, f"{type(exc).__name__}: {exc}"


def _failed_in(failure: str, spec: LaneSpec) -> bool:
    """A failure is recorded as "{task name}: {error}"; one without a known task name is the first lane's."""
    failed_lane = lane_of_task(failure.partition(":")[0])
    return spec is (failed_lane or FIRST_LANE)
