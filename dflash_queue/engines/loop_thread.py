"""An asyncio event loop in its own thread, for async engines called from ordinary (task) threads."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class EventLoopThread:
    """Runs one event loop in a daemon thread; any thread submits a coroutine and blocks on its result.

    Several threads may wait at once: their coroutines interleave on the one loop, which is what lets many
    Celery task threads feed a single async engine.
    """

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    @property
    def running(self) -> bool:
        return self._thread.is_alive() and not self.loop.is_closed()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coroutine` on the loop and wait for its result (its exception is raised here)."""
        if threading.current_thread() is self._thread:
            coroutine.close()
            raise RuntimeError("EventLoopThread.run called from its own loop thread; await instead")
        if not self.running:
            coroutine.close()
            raise RuntimeError("the event loop thread has stopped")
        future = asyncio.run_coroutine_threadsafe(coroutine, self.loop)
        try:
            return future.result(timeout)
        except BaseException:
            future.cancel()
            raise

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel what is still running on the loop, stop it, join the thread and close the loop.

        Tasks that do not finish within `timeout` after being cancelled are abandoned with the loop.
        """
        if self.loop.is_closed():
            return
        if self._thread.is_alive():
            try:
                self.run(_cancel_other_tasks(timeout), timeout=timeout + 5)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self._thread.join(timeout)
        if not self._thread.is_alive():
            self.loop.close()


async def _cancel_other_tasks(timeout: float) -> None:
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
