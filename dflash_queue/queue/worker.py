"""Starting a lane worker: load the engine once, then hand the process to Celery.

Pool choice: the threads pool. Tasks run in a thread of this process, so
  * the engine is loaded once in the process that runs the tasks (no fork after CUDA is initialised);
  * engines that start processes of their own (vLLM) are not inside a daemonic prefork child;
  * the main thread stays free for broker heartbeats and events while a long batch runs (the solo pool
    would block them and Flower would show the worker offline).
"""

from __future__ import annotations

import logging
import socket

from celery import signals

from dflash_queue.config import Config
from dflash_queue.ledger import Ledger
from dflash_queue.queue import runtime
from dflash_queue.queue.app import EXTRACT_QUEUE, GENERATE_QUEUE, configure_app

LANES = {"generate": GENERATE_QUEUE, "extract": EXTRACT_QUEUE}
log = logging.getLogger(__name__)


def build_lane(config: Config, lane: str):
    if lane == "generate":
        from dflash_queue.lanes.generate import GenerateLane, build_generate_engine

        return GenerateLane(config, build_generate_engine(config))
    if lane == "extract":
        from dflash_queue.lanes.extract import ExtractLane, build_extractor

        return ExtractLane(config, build_extractor(config))
    raise ValueError(f"unknown lane {lane!r}; expected one of {sorted(LANES)}")


def run_worker(
    config: Config,
    lane: str,
    *,
    concurrency: int = 1,
    hostname: str | None = None,
    loglevel: str = "INFO",
) -> None:
    app = configure_app(config)
    log.info("loading the %s engine for %s", lane, config.model.display_name)
    rt = runtime.WorkerRuntime(
        config=config,
        fingerprint=config.fingerprint(),
        ledger=Ledger.from_url(config.broker.url, config.run.name),
        lanes={lane: build_lane(config, lane)},
    )
    runtime.install(rt)
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


def _release_engine(**_kwargs) -> None:
    rt = runtime.uninstall()
    if rt is not None:
        log.info("releasing engines")
        rt.close()
