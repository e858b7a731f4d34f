"""Starting a lane worker: load the engine once, then hand the process to Celery.

Pool choice: the threads pool. Tasks run in threads of this one process, so
  * nothing forks after an engine is loaded: the threads pool never forks, and the engine is loaded here, in
    the process that runs the tasks, before Celery starts consuming (a prefork child would inherit a CUDA
    context it cannot use);
  * engines that start processes of their own are not inside a daemonic prefork child (daemonic processes
    may not have children). vLLM starts its engine core and GPU workers from this process, with the spawn
    method (see engines/vllm_generate.py), so they are children of a plain process;
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
way, hands its tasks back to the queue and exits with a failure code (see `LaneTask`).

Storage is checked before the engine is loaded (write, read back, list, delete a probe object): a missing
bucket or denied access stops the worker at once with the reason. The extract worker runs 1 + max_pending task
slots by default so that uploads overlap the next shard's compute (see lanes/extract.py). On warm shutdown,
tasks still waiting for the engine are requeued and the others finish, their uploads included.
"""

from __future__ import annotations

import logging
import socket

from celery import signals

from dflash_queue.config import Config
from dflash_queue.deadletters import DeadLetters
from dflash_queue.ledger import Ledger
from dflash_queue.ops.doctor.broker import durability_warnings
from dflash_queue.queue import runtime
from dflash_queue.queue.app import EXTRACT_QUEUE, GENERATE_QUEUE, configure_app
from dflash_queue.storage import Storage, open_storage
from dflash_queue.storage.checks import require_storage

LANES = {"generate": GENERATE_QUEUE, "extract": EXTRACT_QUEUE}
log = logging.getLogger(__name__)


def build_lane(config: Config, lane: str, storage: Storage | None = None):
    if lane == "generate":
        from dflash_queue.lanes.generate import GenerateLane, build_generate_engine

        return GenerateLane(config, build_generate_engine(config), storage)
    if lane == "extract":
        from dflash_queue.lanes.extract import ExtractLane, build_extractor

        return ExtractLane(config, build_extractor(config), storage)
    raise ValueError(f"unknown lane {lane!r}; expected one of {sorted(LANES)}")


def default_concurrency(config: Config, lane: str) -> int:
    """Task slots unless told otherwise: the vLLM lane keeps `inflight_tasks` shards feeding one engine; the
    extract lane keeps one computing while others wait for their uploads (a task holds one of the uploader's
    max_pending staging slots from before its compute until its shard is stored; the extra slot is a task that
    waits for a staging slot, ready to compute)."""
    if lane == "generate" and config.generate.engine == "vllm":
        return config.generate.vllm.inflight_tasks
    if lane == "extract":
        return 1 + config.storage.uploader.max_pending
    return 1


def _warn_if_engine_can_drain(config: Config, lane: str, concurrency: int) -> None:
    if lane != "generate" or config.generate.engine != "vllm":
        return
    waiting = (concurrency - 1) * config.dataset.shard_size
    if waiting < config.generate.vllm.max_num_seqs:
        log.warning(
            "with %d tasks in flight of %d samples each, the other tasks hold %d requests while one task "
            "finishes, fewer than generate.vllm.max_num_seqs (%d): the engine will run part-empty at task "
            "boundaries; raise generate.vllm.inflight_tasks or dataset.shard_size",
            concurrency,
            config.dataset.shard_size,
            waiting,
            config.generate.vllm.max_num_seqs,
        )


WORKER_LOG_FORMAT = "[%(asctime)s: %(levelname)s/%(processName)s] %(message)s"
EXIT_ENGINE_LOST = 70  # EX_SOFTWARE: the process manager should restart the worker


def open_checked_storage(config: Config) -> Storage:
    """Open the configured storage, prove it writable and readable, and abort stale multipart uploads."""
    storage = open_storage(config.storage)
    for result in require_storage(storage):
        log.info("storage %s: %s", result.check, result.message)
    abort_stale = getattr(storage, "abort_stale_uploads", None)
    if abort_stale is not None and config.storage.s3.abort_stale_uploads_after_s > 0:
        abort_stale()
    return storage


def run_worker(
    config: Config,
    lane: str,
    *,
    concurrency: int | None = None,
    hostname: str | None = None,
    loglevel: str = "INFO",
) -> int:
    """Run a lane worker until it is stopped; returns the process exit code."""
    if lane not in LANES:
        raise ValueError(f"unknown lane {lane!r}; expected one of {sorted(LANES)}")
    # Logging from the start, in Celery's format (Celery keeps a root logger that is already set up), so that
    # start-up warnings and the engine's loading carry a level and a time.
    logging.basicConfig(level=loglevel.upper(), format=WORKER_LOG_FORMAT)
    app = configure_app(config)
    concurrency = concurrency or default_concurrency(config, lane)
    _warn_if_engine_can_drain(config, lane, concurrency)
    for warning in durability_warnings(config.broker.url):
        log.warning("%s", warning)
    storage = open_checked_storage(config)
    log.info("loading the %s engine for %s", lane, config.model.display_name)
    rt = runtime.WorkerRuntime(
        config=config,
        fingerprint=config.fingerprint(),
        ledger=Ledger.from_url(config.broker.url, config.run.name),
        lanes={lane: build_lane(config, lane, storage)},
        storage=storage,
        dead_letters=DeadLetters.from_url(config.broker.url, config.run.name),
    )
    runtime.install(rt)
    signals.worker_shutting_down.connect(_begin_shutdown, weak=False)
    signals.worker_shutdown.connect(_release_engine, weak=False)
    node = hostname or f"{lane}-{config.run.name}@{socket.gethostname()}"
    code = app.start(
        [
            "worker",
            f"--queues={LANES[lane]}",
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
        return EXIT_ENGINE_LOST
    return code or 0


def _begin_shutdown(**_kwargs) -> None:
    try:
        runtime.current().begin_shutdown()
    except RuntimeError:  # no runtime installed: nothing to tell
        pass


def _release_engine(**_kwargs) -> None:
    rt = runtime.uninstall()
    if rt is not None:
        log.info("releasing engines")
        rt.close()
