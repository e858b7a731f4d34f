"""A task whose shard found the window of unconsumed shards full (WindowFull) goes to the back of the queue.

A new message at the back of the queue, then this one acknowledged: shards behind it get their turn, and a wait of
hours never outlives the broker's visibility timeout. The delivery is uncounted: the task did not run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from celery.utils.log import get_task_logger

from dflash_queue.errors import WindowFull

log = get_task_logger(__name__)


@contextmanager
def requeued_when_window_full(send_again: Callable[[], None], uncount: Callable[[], None]) -> Iterator[None]:
    """Swallows WindowFull once the task is sent again: the task then returns nothing and is acknowledged."""
    try:
        yield
    except WindowFull as exc:
        uncount()
        send_again()
        log.info("%s", exc)
