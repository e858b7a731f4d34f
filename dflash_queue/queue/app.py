"""The Celery app and its settings, built from a deployment config: one queue and one task per lane of the
registry (dflash_queue.lanes.registry)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from celery import Celery
from kombu import Exchange, Queue

from dflash_queue.config import Config
from dflash_queue.errors import ConfigError
from dflash_queue.lanes.registry import FIRST_LANE, LANES
from dflash_queue.queue.config import BrokerConfig
from dflash_queue.runstate.redis_connect import kombu_broker

if TYPE_CHECKING:  # a worker's runtime holds its engines: a command that only reads the broker never imports it
    from dflash_queue.queue.runtime import WorkerRuntime


class LaneApp(Celery):
    """The Celery app. A worker process attaches its runtime here before it consumes; tasks reach it through
    their base class (`LaneTask.runtime`), the consumer through its app."""

    worker_runtime: WorkerRuntime | None = None

    def runtime(self) -> WorkerRuntime:
        if self.worker_runtime is None:
            raise RuntimeError("no worker runtime in this process; start workers with `dflash-queue worker`")
        return self.worker_runtime


app = LaneApp("dflash_queue", include=["dflash_queue.queue.tasks"])


def celery_settings(broker: BrokerConfig, source: str) -> dict:
    """The app's settings for the run's broker; `source` (where the config came from) names the file when the
    broker's URL is missing."""
    if not broker.url:
        raise ConfigError(f"{source}: broker.url is empty; set it (or {'DFQ_BROKER_URL'}) or use `dflash-queue run`")
    # A Sentinel url becomes kombu's form, its master's name and the sentinels' password transport options.
    broker_url, sentinel_options = kombu_broker(broker.connection_url())
    transport = {
        **sentinel_options,
        "visibility_timeout": broker.visibility_timeout_s,
        # Messages of workers that died come back once older than the visibility timeout; look for them
        # every minute (or a quarter of a short timeout), not kombu's default of every 100 s.
        "unacked_restore_interval": max(1, min(60, broker.visibility_timeout_s // 4)),
        "unacked_restore_throttle": 1,
        # Redis can drop idle connections behind NAT or proxies; keep them alive and notice breaks.
        "socket_keepalive": True,
        "health_check_interval": 25,
    }
    return {
        "broker_url": broker_url,
        "broker_transport_options": transport,
        "broker_connection_retry_on_startup": True,
        "broker_connection_max_retries": None,
        # Messages are references (shard ids, counts, a fingerprint); nothing needs pickle.
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "event_serializer": "json",
        # Results are never read: the outputs live in storage and progress in the ledger.
        "task_ignore_result": True,
        "result_backend": None,
        # At-least-once delivery: a task whose worker dies is delivered again, never lost.
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_queues": tuple(
            Queue(spec.queue, Exchange(spec.queue), routing_key=spec.queue) for spec in LANES.values()
        ),
        "task_routes": {spec.task_name: {"queue": spec.queue, "routing_key": spec.queue} for spec in LANES.values()},
        "task_default_queue": FIRST_LANE.queue,
        # Events for Flower.
        "worker_send_task_events": True,
        "task_send_sent_event": True,
        "task_track_started": True,
        "worker_hijack_root_logger": False,
        # Messages that cannot be run (bad JSON, unknown task) become dead letters before they are dropped.
        "worker_consumer": "dflash_queue.deadletters.recording:WorkerConsumer",
    }


def configure_app(config: Config) -> Celery:
    """The process's app, set up for `config`'s broker. Takes the whole Config: it is what every command, worker
    and test hands in before it sends or consumes (the app itself reads the broker section only)."""
    app.conf.update(celery_settings(config.broker, config.source))
    return app
