"""A message made under other settings than the worker's is refused for good (a dead letter)."""

from __future__ import annotations

from dflash_queue.errors import FingerprintMismatch
from dflash_queue.queue.steps.lane_message import LaneMessage


def check_fingerprint(message: LaneMessage, worker_fingerprint: str, config_source: str) -> None:
    if message.fingerprint != worker_fingerprint:
        raise FingerprintMismatch(
            f"shard {message.shard_id}: message fingerprint {message.fingerprint} != worker config fingerprint "
            f"{worker_fingerprint} ({config_source}); the worker runs a different model or settings than the producer"
        )
