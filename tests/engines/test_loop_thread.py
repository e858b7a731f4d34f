from __future__ import annotations

import asyncio
import concurrent.futures
import threading

import pytest

from dflash_queue.engines.loop_thread import EventLoopThread


@pytest.fixture
def loop_thread():
    runner = EventLoopThread("test-loop")
    yield runner
    runner.stop(timeout=5)


def test_coroutines_from_several_threads_interleave_on_one_loop(loop_thread):
    started = asyncio.Event()
    gate = threading.Barrier(3)
    results: dict[int, tuple[int, str]] = {}

    async def work(index: int) -> tuple[int, str]:
        if index == 0:
            await started.wait()  # finishes only because another thread's coroutine ran meanwhile
        else:
            started.set()
        return index, threading.current_thread().name

    def call(index: int) -> None:
        gate.wait()
        results[index] = loop_thread.run(work(index), timeout=30)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert results == {i: (i, "test-loop") for i in range(3)}


def test_errors_reach_the_caller(loop_thread):
    async def fail() -> None:
        raise KeyError("boom")

    with pytest.raises(KeyError, match="boom"):
        loop_thread.run(fail())

    async def nested() -> None:
        loop_thread.run(asyncio.sleep(0))

    with pytest.raises(RuntimeError, match="own loop thread"):
        loop_thread.run(nested())


def test_stop_cancels_what_runs_and_refuses_more(loop_thread):
    running, cancelled = threading.Event(), threading.Event()
    outcome: list[type] = []

    async def forever() -> None:
        running.set()
        try:
            await asyncio.sleep(3600)
        finally:
            cancelled.set()

    def wait() -> None:
        try:
            loop_thread.run(forever())
        except BaseException as exc:  # recorded and checked below
            outcome.append(type(exc))

    waiter = threading.Thread(target=wait)
    waiter.start()
    assert running.wait(timeout=10)
    loop_thread.stop(timeout=5)
    waiter.join(timeout=10)
    assert cancelled.is_set() and outcome == [concurrent.futures.CancelledError]
    assert loop_thread.loop.is_closed() and not loop_thread.running
    with pytest.raises(RuntimeError, match="stopped"):
        loop_thread.run(asyncio.sleep(0))
