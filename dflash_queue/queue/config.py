"""The `[broker]` section: the Redis broker and how tasks are delivered and retried."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, model_validator

from dflash_queue.settings import PositiveFloat, PositiveInt, Section


class BrokerConfig(Section):
    url: str = ""
    """Empty: `dflash-queue run` starts a private redis-server; workers need a URL."""
    visibility_timeout_s: PositiveInt = 4 * 3600
    """Redis has no lease a running task can extend: an unacked message older than this is handed to another
    worker. It must exceed the longest task."""
    task_timeout_s: PositiveInt = 2 * 3600
    """The longest a task may take; warm shutdown waits this long (plus a margin) for a running task."""
    worker_liveness_s: Annotated[int, Field(ge=3)] = 30
    """A worker's heartbeat (a key refreshed every third of this) expires this long after the worker stops: the
    messages it held (running or reserved) are then put back on their queues by any live worker within about
    1.3 times this, instead of after visibility_timeout_s."""
    max_deliveries: PositiveInt = 3
    """A task delivered more often than this (its worker died each time: OOM-kill, segfault, SIGKILL) goes to the
    dead letters instead of taking down one more worker."""
    transient_retries: PositiveInt = 8
    """Retries of a task whose broker or storage connection failed (exponential backoff with jitter)."""
    retry_backoff_max_s: PositiveFloat = 120.0
    """Cap of the delay between retries of a task: a random delay of 1 s up to 2 s, 4 s, 8 s ... (exponential
    backoff with full jitter)."""

    @model_validator(mode="after")
    def _visibility_exceeds_longest_task(self) -> BrokerConfig:
        if self.visibility_timeout_s <= self.task_timeout_s:
            raise ValueError(
                f"visibility_timeout_s ({self.visibility_timeout_s}) must exceed task_timeout_s "
                f"({self.task_timeout_s}), or running tasks are re-delivered to other workers"
            )
        if self.url and not self.url.startswith(("redis://", "rediss://", "redis+socket://", "unix://")):
            raise ValueError(f"url must be a redis:// or rediss:// URL, got {self.url!r}")
        return self
