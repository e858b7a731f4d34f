"""Reading training shards in a training loop: a map-style Dataset and a padding collate function."""

from dflash_queue.shards.suspect_lookup import SuspectShardError
from dflash_queue.training.collate import collate_padded
from dflash_queue.training.dataset import SampleFilter, ShardDataset

__all__ = ["SampleFilter", "ShardDataset", "SuspectShardError", "collate_padded"]
