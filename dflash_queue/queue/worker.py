"""Starting a lane worker: load the engine once, then hand the process to Celery.

Pool choice: the threads pool. Tasks run in threads of this one process, so
  * nothing forks after an engine is loaded: the threads pool never forks, and the engine is loaded here, in
    the process that runs the tasks, before Celery starts consuming (a prefork child would inherit a CUDA
    context it cannot use);
  * engines that start processes of their own are not inside a daemonic prefork child (daemonic processes
    may not have children). vLLM starts its engine core and GPU workers from this process, with the spawn
    method (see engines/vllm/generate.py), so they are children of a plain process;
  * the main thread stays free for broker heartbeats and events while a long batch runs (the solo pool
    would block them and Flower would show the worker offline); task threads wait on the engine with the
    GIL released;
  * several tasks can share one resident engine: the vLLM lane runs `generate.vllm.inflight_tasks` tasks at
    once against one async engine, so a new shard starts decoding while the previous shard's tail finishes.
    With `worker_prefetch_multiplier = 1` and late acks the worker holds exactly as many messages as it runs.

Shutdown: SIGTERM is Celery's warm shutdown. The worker stops consuming, tasks in flight finish (their
messages are acked only then); messages it held but had not started go back to the queue. Then
`worker_shutdown` releases the engines: vLLM's processes are told to exit and are killed if they outlive
`generate.vllm.shutdown_timeout_s`, so none outlives the worker. A worker whose engine died stops the same
way, hands its tasks back to the queue and exits with a failure code (EXIT_ENGINE_LOST, 70: restarted; see
queue/steps/hand_back.py). So does a worker whose engine failed its state checks on `extract.stop_after_failed_checks` shards in
a row, with EXIT_FAILING_CHECKS (78), which the shipped systemd units do not restart on: the shards wait in the
queue for a healthy worker, and the run's `status` shows the stop and its reason (queue/check_streak.py). A
worker clears its node's stop record when it starts. A worker whose node name a live worker holds (another
container of this host, say) is refused at start, before anything loads (queue/heartbeat.py: NodeNameInUse).

Storage is checked before the engine is loaded (write, read back, list, delete a probe object): a missing
bucket or denied access stops the worker at once with the reason. The extract worker runs 1 + max_pending task
slots by default so that uploads overlap the next shard's compute (see lanes/extract.py). On warm shutdown,
tasks still waiting for the engine are requeued and the others finish, their uploads included.
"""

from __future__ import annotations

import logging
import socket

from celery import signals

from dflash_queue import faults
from dflash_queue.config import Config
from dflash_queue.deadletters import DeadLetters
from dflash_queue.doctor.broker import durability_warnings, login_error
from dflash_queue.errors import BrokerLoginRefused, ReferenceMismatch
from dflash_queue.lanes.registry import FINAL_LANE, lane
from dflash_queue.queue.app import LaneApp, configure_app
from dflash_queue.queue.audit_halt import stop_if_halted
from dflash_queue.queue.heartbeat import Heartbeat
from dflash_queue.queue.runtime import EXIT_ENGINE_LOST, WorkerRuntime
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.runstate.stopped_workers import EXIT_FAILING_CHECKS, StoppedWorker, StoppedWorkers
from dflash_queue.storage import Storage, open_storage
from dflash_queue.storage.checks import require_storage
from dflash_queue.storage.config import StorageConfig

log = logging.getLogger(__name__)


WORKER_LOG_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"
__all__ = ["EXIT_ENGINE_LOST", "default_node_name", "open_checked_storage", "run_worker"]


def open_checked_storage(settings: StorageConfig) -> Storage:
    """Open the configured storage, prove it writable and readable, and abort stale multipart uploads."""
    storage = open_storage(settings)
    for result in require_storage(storage):
        log.info("storage %s: %s", result.check, result.message)
    abort_stale = getattr(storage, "abort_stale_uploads", None)
    if abort_stale is not None and settings.s3.abort_stale_uploads_after_s > 0:
        abort_stale()
    return storage


def default_node_name(lane: str, run: str, gpus: str = "") -> str:
    """`LANE-RUN@HOST`, or `LANE-RUN-gpuGPUS@HOST` for a worker given GPUs (`gpus` in the systemd instance form:
    `0`, `0-3`, `0_2`): the workers of one node, each on GPUs of its own, have names of their own."""
    return f"{lane}-{run}{f'-gpu{gpus}' if gpus else ''}@{socket.gethostname()}"


def run_worker(
    config: Config,
    lane_name: str,
    *,
    concurrency: int | None = None,
    hostname: str | None = None,
    loglevel: str = "INFO",
) -> int:
    """Run a lane worker until it is stopped; returns the process exit code. Takes the whole Config: it builds the
    worker's parts (app, storage, lane, runtime), each from the sections it reads."""
    spec = lane(lane_name)
    faults.refuse_uninstalled()
    # Logging from the start, in Celery's format (Celery keeps a root logger that is already set up), so that
    # start-up warnings and the engine's loading carry a level and a time.
    logging.basicConfig(level=loglevel.upper(), format=WORKER_LOG_FORMAT)
    app = configure_app(config)
    broker_url = config.broker.connection_url()
    # Celery retries a refused login for ever, as it would a broker that is down: a wrong password stops the
    # worker here instead, saying so.
    refused = login_error(broker_url)
    if refused:
        raise BrokerLoginRefused(refused)
    node = hostname or default_node_name(spec.name, config.run.name)
    heartbeat = Heartbeat(app, broker_url, config.run.name, node, config.broker.worker_liveness_s)
    # Not beside a live worker of the same name (another container on this host, say): each would put back the
    # other's messages as a dead predecessor's. Refused with exit status 1: restarted after RestartSec, by when the
    # heartbeat of a namesake that is in fact gone has expired.
    heartbeat.refuse_live_namesakes()
    # A worker restarted under its name (systemd) puts back what its dead predecessor held, before its engine loads.
    heartbeat.succeed_predecessors()
    concurrency = concurrency or spec.default_slots(config)
    for warning in [*spec.startup_warnings(config, concurrency), *durability_warnings(broker_url)]:
        log.warning("%s", warning)
    storage = open_checked_storage(config.storage)
    ledger = Ledger.from_url(broker_url, config.run.name)
    before = StoppedWorkers(ledger.client, config.run.name).clear(node)
    if before is not None:
        log.warning("a worker named %s stopped before: %s", node, before.reason)
    log.info("loading the %s engine for %s", spec.name, config.model.display_name)
    try:
        resident = spec.build(config, storage)
    except ReferenceMismatch as exc:  # not the shards' fault: a restart would load into the same mismatch
        reason = f"{type(exc).__name__}: {exc}"
        log.error("the %s engine refused to start: %s", spec.name, reason)
        StoppedWorkers(ledger.client, config.run.name).record(StoppedWorker(node, spec.name, config.extract.engine, reason))
        return EXIT_FAILING_CHECKS
    rt = WorkerRuntime(
        config=config,
        fingerprint=config.fingerprint(),
        ledger=ledger,
        lanes={spec.name: resident},
        dead_letters=DeadLetters.from_url(broker_url, config.run.name),
        storage=storage,
        node=node,
        incarnation=heartbeat.incarnation.id,
    )
    if spec is FINAL_LANE:
        heartbeat.on_beat.append(lambda: stop_if_halted(rt, spec.name))
    _attach(app, rt, heartbeat)
    code = app.start(
        [
            "worker",
            f"--queues={spec.queue}",
            "--pool=threads",
            f"--concurrency={concurrency}",
            f"--hostname={node}",
            f"--loglevel={loglevel}",
            "--task-events",
            "--without-mingle",
            "--without-gossip",
        ]
    )
    if rt.stop_reason is not None:
        log.error("worker stopped: %s", rt.stop_reason)
        return rt.exit_code
    return code or 0


def _attach(app: LaneApp, rt: WorkerRuntime, heartbeat: Heartbeat) -> None:
    """Hand the runtime to the app's tasks; the heartbeat starts once the worker consumes; warm shutdown tells the
    lanes, worker shutdown (once tasks in flight finished) stops the heartbeat and releases the engines."""
    app.worker_runtime = rt

    def start_heartbeat(**_kwargs) -> None:
        heartbeat.start()

    def begin_shutdown(**_kwargs) -> None:
        rt.begin_shutdown()

    def release_engines(**_kwargs) -> None:
        heartbeat.stop()
        if app.worker_runtime is rt:
            app.worker_runtime = None
            log.info("releasing engines")
            rt.close()

    signals.worker_ready.connect(start_heartbeat, weak=False)
    signals.worker_shutting_down.connect(begin_shutdown, weak=False)
    signals.worker_shutdown.connect(release_engines, weak=False)
