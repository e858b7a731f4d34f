"""Where prompts, completions and training shards live: a local directory now, object stores behind the same
protocol."""

from dflash_queue.storage.base import RangeReadable, Storage
from dflash_queue.storage.factory import open_storage
from dflash_queue.storage.local import LocalStorage

__all__ = ["LocalStorage", "RangeReadable", "Storage", "open_storage"]
