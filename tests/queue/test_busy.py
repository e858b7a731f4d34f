from __future__ import annotations

import pytest

from dflash_queue.queue.busy import BusyClock


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_overlapping_tasks_count_busy_time_once():
    fake = FakeClock()
    clock = BusyClock(fake)
    clock.start()  # task A at 0
    fake.now = 2.0
    clock.start()  # task B at 2, overlapping A
    fake.now = 5.0
    first = clock.stop()  # A ends: busy 0..5
    fake.now = 7.0
    second = clock.stop()  # B ends: busy 5..7
    assert (first, second) == (5.0, 2.0)  # 7 s of wall-clock busy, not 5 + 5

    fake.now = 10.0  # idle 7..10 is not busy
    with clock.task() as timing:
        fake.now = 12.5
    assert timing.busy_ms == 2500


def test_stop_without_start_is_an_error():
    with pytest.raises(RuntimeError):
        BusyClock().stop()
