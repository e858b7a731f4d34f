"""A task finding the window full is sent again and this delivery uncounted; other errors pass through."""

from __future__ import annotations

import pytest

from dflash_queue.errors import WindowFull
from dflash_queue.queue.steps.window_requeue import requeued_when_window_full


def test_a_full_window_uncounts_the_delivery_then_sends_the_task_again_and_ends_it():
    calls = []
    with requeued_when_window_full(lambda: calls.append("sent"), lambda: calls.append("uncounted")):
        raise WindowFull("shard s1 (epoch 0): 1 shards wait")
    assert calls == ["uncounted", "sent"]


def test_other_errors_and_success_are_left_alone():
    calls = []
    with requeued_when_window_full(lambda: calls.append("sent"), lambda: calls.append("uncounted")):
        pass
    with pytest.raises(ValueError), requeued_when_window_full(lambda: calls.append("sent"), lambda: calls.append("x")):
        raise ValueError("not the window")
    assert calls == []
