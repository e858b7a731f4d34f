"""Reading training shards in a training loop: a map-style Dataset and a padding collate function."""

from dflash_queue.training.collate import collate_padded
from dflash_queue.training.dataset import SampleFilter, ShardDataset

__all__ = ["SampleFilter", "ShardDataset", "collate_padded"]
