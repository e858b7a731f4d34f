"""Training while a run extracts: a live dataset over the running job, storage bounded by a window, and epochs
extracted again from stored completions."""

from dflash_queue.live.dataset import LiveSamples, LiveShard, LiveShards

__all__ = ["LiveSamples", "LiveShard", "LiveShards"]
