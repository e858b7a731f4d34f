"""A message made under other settings than the worker's is refused."""

from __future__ import annotations

import pytest

from dflash_queue.errors import FingerprintMismatch, PermanentError
from dflash_queue.queue.steps.fingerprint import check_fingerprint
from dflash_queue.queue.steps.lane_message import LaneMessage


def test_a_message_of_other_settings_is_refused_for_good_and_its_own_passes():
    check_fingerprint(LaneMessage("s1", 8, "aaa"), "aaa", "worker.toml")
    with pytest.raises(FingerprintMismatch, match=r"shard s1: message fingerprint bbb != worker config fingerprint "
                                                  r"aaa \(worker.toml\)") as refused:
        check_fingerprint(LaneMessage("s1", 8, "bbb"), "aaa", "worker.toml")
    assert isinstance(refused.value, PermanentError)
