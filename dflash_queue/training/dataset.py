"""A map-style PyTorch Dataset over training shards, for training loops and DataLoaders.

    dataset = ShardDataset("out/local-cpu", finish_reasons={"stop"}, drop_flagged=True)
    loader = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=4, collate_fn=collate_padded)

Construction reads each shard's header and offsets (not its tensors) to build a global index; `dataset[i]`
then reads only sample i's rows: a few positioned reads on a local file, ranged reads on object storage.
The dataset pickles without open files or clients, and a copy in a new process (DataLoader worker, fork or
spawn) opens its own.

A shard the reference audit found suspect (a mark beside it in the run's storage: shards/suspects.py) is never
served: found by listing, it is left out with one warning naming each (`suspect_shards` lists them); named (a shard
file or URL, `keys`), it is refused (SuspectShardError) unless `on_suspect_shard="skip"`.
"""

from __future__ import annotations

import os
import pickle
import warnings
from collections import Counter, OrderedDict
from collections.abc import Callable, Collection, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.locate import ShardsArg, ShardSet, locate_shards
from dflash_queue.shards.ranges import ByteSource, open_source
from dflash_queue.shards.reader import SampleMeta, ShardIndex, read_sample
from dflash_queue.shards.suspect_lookup import SuspectShardError, suspect_marks
from dflash_queue.storage.factory import open_storage
from dflash_queue.storage.local import LocalStorage

HIDDEN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Shards a process keeps open at once (least recently read closed first).
MAX_OPEN_SHARDS = 64
# Suspect shards a warning names one by one (`suspect_shards` holds them all).
NAMED_SUSPECTS = 10


@dataclass(frozen=True)
class SampleFilter:
    """Which samples a dataset keeps. Flags are the quality gate's per-sample flags."""

    finish_reasons: frozenset[str] | None = None  # keep only these (e.g. {"stop"}); None keeps all
    exclude_flags: frozenset[str] = frozenset()  # drop a sample carrying any of these flags
    drop_flagged: bool = False  # drop a sample carrying any flag at all
    where: Callable[[SampleMeta], bool] | None = None  # drop a sample this returns False for

    def reason_to_drop(self, meta: SampleMeta) -> str | None:
        if self.finish_reasons is not None and meta.finish_reason not in self.finish_reasons:
            return f"finish_reason={meta.finish_reason}"
        if meta.quality_flags and (self.drop_flagged or self.exclude_flags.intersection(meta.quality_flags)):
            return "flagged"
        if self.where is not None and not self.where(meta):
            return "where"
        return None


class ShardDataset(Dataset):
    """Samples of many shards, item i -> dict with

    `input_ids`, `loss_mask` int64 [T]; `hidden_states` [T, K, H] in `hidden_dtype` (fp8 shards dequantised;
    with `dequantize=False` they come as stored, float8_e4m3fn, with `hidden_scales` float32 [T, K] to
    dequantise on the GPU with `dflash_queue.shards.fp8.dequantize_fp8`);
    `sample_id`, `finish_reason`, `thinking`, `quality_flags` (list of str), `shard` (storage key).
    Shard-level facts are attributes: `layer_ids`, `hidden_size`, `target_model`, `layer_convention`.

    `on_suspect_shard`: what becomes of a shard the reference audit marked suspect. None (the default): left out
    with a warning when the shards were found by listing, refused (SuspectShardError) when named; "skip": left out;
    "raise": refused. Either way it is never read.
    """

    def __init__(
        self,
        shards: ShardsArg,
        *,
        keys: Sequence[str] | None = None,
        prefix: str = "",
        hidden_dtype: torch.dtype = torch.bfloat16,
        dequantize: bool = True,
        finish_reasons: Collection[str] | None = None,
        exclude_flags: Collection[str] = (),
        drop_flagged: bool = False,
        where: Callable[[SampleMeta], bool] | None = None,
        on_bad_shard: Literal["skip", "raise"] = "skip",
        on_suspect_shard: Literal["skip", "raise"] | None = None,
        index_threads: int = 8,
    ) -> None:
        if hidden_dtype not in HIDDEN_DTYPES:
            raise ValueError(f"hidden_dtype must be one of {HIDDEN_DTYPES}, got {hidden_dtype}")
        located = locate_shards(shards, keys=keys, prefix=prefix)
        self.hidden_dtype = hidden_dtype
        self.dequantize = dequantize
        self.filter = SampleFilter(
            frozenset(finish_reasons) if finish_reasons is not None else None,
            frozenset(exclude_flags),
            drop_flagged,
            where,
        )
        self._storage = located.storage
        self._storage_url = located.url
        self._pid = os.getpid()
        self._sources: OrderedDict[int, ByteSource] = OrderedDict()

        self.keys: list[str] = []
        self.shards: list[ShardIndex] = []
        # (storage key, message) of every shard left out; see also `on_bad_shard`.
        self.bad_shards: list[tuple[str, str]] = []
        # (storage key, what its mark says) of every shard left out as suspect.
        self.suspect_shards: list[tuple[str, str]] = []
        located = self._without_suspects(located, on_suspect_shard)
        for key, loaded in zip(located.keys, self._load_indexes(located, index_threads), strict=True):
            problem = loaded if isinstance(loaded, str) else self._disagreement(loaded)
            if problem is not None:
                if on_bad_shard == "raise":
                    raise ShardFormatError(problem)
                warnings.warn(f"skipping shard: {problem}", stacklevel=2)
                self.bad_shards.append((key, problem))
                continue
            assert not isinstance(loaded, str)  # a str is a problem, handled above
            self.keys.append(key)
            self.shards.append(loaded)

        shard_of: list[int] = []
        rows: list[int] = []
        lengths: list[int] = []
        self.dropped: Counter[str] = Counter()  # samples left out by the filter, by reason
        for position, index in enumerate(self.shards):
            for row in range(index.num_samples):
                meta = index.sample_meta(row)
                reason = self.filter.reason_to_drop(meta)
                if reason is None:
                    shard_of.append(position)
                    rows.append(row)
                    lengths.append(meta.num_tokens)
                else:
                    self.dropped[reason] += 1
        self._shard_of = np.asarray(shard_of, dtype=np.int32)
        self._rows = np.asarray(rows, dtype=np.int32)
        self._lengths = np.asarray(lengths, dtype=np.int64)

    # -- the Dataset protocol

    def __len__(self) -> int:
        return int(self._rows.shape[0])

    def __getitem__(self, i: int) -> dict[str, Any]:
        position, row = self._locate(i)
        index = self.shards[position]
        item: dict[str, Any] = read_sample(
            index, self._source(position), row, self.hidden_dtype, dequantize=self.dequantize
        )
        item.update(
            sample_id=index.sample_ids[row],
            finish_reason=index.finish_reasons[row],
            thinking=index.thinking[row],
            quality_flags=list(index.quality_flags[row]),
            shard=self.keys[position],
        )
        return item

    # -- what is known without reading tensors

    def meta(self, i: int) -> SampleMeta:
        position, row = self._locate(i)
        return self.shards[position].sample_meta(row)

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per kept sample (for length-bucketing samplers), from the offsets alone."""
        return self._lengths.copy()

    @property
    def num_tokens(self) -> int:
        return int(self._lengths.sum())

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self._first.layer_ids

    @property
    def hidden_size(self) -> int:
        return self._first.hidden_size

    @property
    def target_model(self) -> str:
        return self._first.metadata.get("target_model", "")

    @property
    def layer_convention(self) -> str:
        return self._first.metadata.get("layer_convention", "")

    # -- process-local state: sources (open files, clients) never cross a process boundary

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_sources"] = OrderedDict()
        # `where` did its work when the index was built; a lambda would not pickle (spawned workers).
        state["filter"] = replace(self.filter, where=None)
        if not isinstance(self._storage, LocalStorage):
            try:
                pickle.dumps(self._storage)
            except Exception:
                if self._storage_url is None:
                    raise TypeError(
                        f"{type(self._storage).__name__} cannot be sent to another process; build the dataset "
                        "from the storage URL instead, so that each worker opens its own"
                    ) from None
                state["_storage"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if self._storage is None:
            self._storage = open_storage(self._storage_url)
        self._pid = os.getpid()

    def _source(self, position: int) -> ByteSource:
        if self._pid != os.getpid():
            # A forked copy: drop the parent's sources and, for a remote storage opened from a URL, its client.
            self._sources = OrderedDict()
            if not isinstance(self._storage, LocalStorage) and self._storage_url is not None:
                self._storage = open_storage(self._storage_url)
            self._pid = os.getpid()
        source = self._sources.get(position)
        if source is None:
            if len(self._sources) >= MAX_OPEN_SHARDS:  # stay far below the open-files limit
                self._sources.popitem(last=False)[1].close()
            source = self._sources[position] = open_source(self._storage, self.keys[position])
        else:
            self._sources.move_to_end(position)
        return source

    def _locate(self, i: int) -> tuple[int, int]:
        if i < 0:
            i += len(self)
        if not 0 <= i < len(self):
            raise IndexError(f"sample {i} of {len(self)}")
        return int(self._shard_of[i]), int(self._rows[i])

    @property
    def _first(self) -> ShardIndex:
        if not self.shards:
            raise ShardFormatError("the dataset holds no readable shard")
        return self.shards[0]

    def _without_suspects(self, located: ShardSet, on_suspect: Literal["skip", "raise"] | None) -> ShardSet:
        """`located` less its suspect shards, each recorded in `suspect_shards` (and warned of when found by
        listing); SuspectShardError when they must be refused."""
        marks = suspect_marks(located.storage, located.keys)
        if not marks:
            return located
        if on_suspect == "raise" or (on_suspect is None and not located.listed):
            raise SuspectShardError.named(marks, located.storage.url)
        self.suspect_shards = [(key, mark.describe()) for key, mark in marks.items()]
        if on_suspect is None:
            named = "; ".join(f"{key} ({mark.reason})" for key, mark in list(marks.items())[:NAMED_SUSPECTS])
            more = len(marks) - NAMED_SUSPECTS
            warnings.warn(
                f"leaving out {len(marks)} suspect shard(s) of {located.storage.url}: a reference audit of the extract "
                "worker that stored them failed, so their states may not be the model's (`dflash-queue suspects "
                f"reextract -c CONFIG` extracts them again): {named}"
                + (f"; and {more} more (the dataset's suspect_shards lists them all)" if more > 0 else ""),
                stacklevel=3,
            )
        return replace(located, keys=tuple(key for key in located.keys if key not in marks))

    def _load_indexes(self, located: ShardSet, threads: int) -> list[ShardIndex | str]:
        def load(key: str) -> ShardIndex | str:
            try:
                return ShardIndex.load(open_source(located.storage, key))
            except ShardFormatError as exc:
                return str(exc)
            except FileNotFoundError:
                return f"{located.where(key)}: no such object"

        if isinstance(located.storage, LocalStorage) or threads <= 1 or len(located.keys) <= 1:
            return [load(key) for key in located.keys]
        with ThreadPoolExecutor(max_workers=threads, thread_name_prefix="dfq-index") as pool:
            return list(pool.map(load, located.keys))

    def _disagreement(self, index: ShardIndex) -> str | None:
        """Every shard of one dataset must describe the same layers of the same model."""
        if not self.shards:
            return None
        first = self.shards[0]
        for name, mine, theirs in (
            ("layer_ids", index.layer_ids, first.layer_ids),
            ("hidden_size", index.hidden_size, first.hidden_size),
            ("layer_convention", index.metadata.get("layer_convention"), first.metadata.get("layer_convention")),
            ("target_model", index.metadata.get("target_model"), first.metadata.get("target_model")),
        ):
            if mine != theirs:
                return f"{index.where}: {name} {mine!r} differs from {theirs!r} in {first.where}"
        return None
