"""Starting a lane worker: load the engine once, then hand the process to Celery.

Pool choice: the threads pool. Tasks run in a thread of this process, so
  * the engine is loaded once in the process that runs the tasks (no fork after CUDA is initialised);
  * engines that start processes of their own (vLLM) are not inside a daemonic prefork child;
  * the main thread stays free for broker heartbeats and events while a long batch runs (the solo pool
    would block them and Flower would show the worker offline).

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
from dflash_queue.ledger import Ledger
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
    """Task slots: the extract lane keeps one computing while up to max_pending wait for their uploads."""
    return 1 + config.storage.uploader.max_pending if lane == "extract" else 1


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
) -> None:
    if lane not in LANES:
        raise ValueError(f"unknown lane {lane!r}; expected one of {sorted(LANES)}")
    app = configure_app(config)
    storage = open_checked_storage(config)
    log.info("loading the %s engine for %s", lane, config.model.display_name)
    rt = runtime.WorkerRuntime(
        config=config,
        fingerprint=config.fingerprint(),
        ledger=Ledger.from_url(config.broker.url, config.run.name),
        lanes={lane: build_lane(config, lane, storage)},
        storage=storage,
    )
    runtime.install(rt)
    concurrency = concurrency or default_concurrency(config, lane)
    signals.worker_shutting_down.connect(_begin_shutdown, weak=False)
    signals.worker_shutdown.connect(_release_engine, weak=False)
    node = hostname or f"{lane}-{config.run.name}@{socket.gethostname()}"
    app.worker_main(
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
