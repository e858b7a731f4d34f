"""Training shards of a run while it runs: a trainer follows the job, acknowledges what it consumed, and the
window (extract.max_unconsumed_shards) with storage.retention = "until-consumed" keeps storage bounded.

    live = LiveShards("worker_configs/my-run.toml", consumer="drafter", epochs=2)
    for shard in live:                      # a ShardDataset per training shard, as it is stored
        for batch in DataLoader(shard, batch_size=8, collate_fn=collate_padded):
            train_step(batch)
        live.ack(shard)                     # consumed: never served to this consumer again in this epoch

or, under a DataLoader with workers, `live.samples()` (one sample at a time, the rank's shards spread over the
loader's workers) with `live.consumed(batch)` after each step (a shard is acknowledged once all its samples were).

Each epoch's shards are split over `world_size` ranks in the order they are stored (recorded once in the broker,
so every process splits them alike): the shard stored n-th goes to rank n % world_size. No shard is served twice
in an epoch, ranks' counts differ by at most one, and whichever shard is stored next goes to the next rank, so
ranks that train in step never wait on each other's shards while the window is full. The order an epoch is
extracted in is its own: a later epoch's is a seeded shuffle (`seed`). A rank ends the epoch once every shard of
it is stored or failed for good and its own are consumed.
The consumer's acknowledgements live in the broker: a rank restarted after a kill serves what it had not
acknowledged, and only that. A later epoch starts (its extraction enqueued) as soon as the previous one's
extraction is over, by whichever rank sees it first.

A shard the reference audit found suspect (its record in the broker, or its mark in storage) is never read: the rank
whose shard it is gives its place in the window back (suspect shards never fill the window), serves the others, and
serves it once it is extracted again (`dflash-queue suspects reextract`) and stored anew; it waits for it before it
ends the epoch. One whose re-extraction fails for good is left out as a failed one is. A consumer that acknowledges a
shard after it turned suspect (it was served before) is added to the suspect's consumers, which `status` and
`verify` name.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, overload

import torch
from torch.utils.data import IterableDataset, get_worker_info

from dflash_queue.broker.run_broker import running_broker
from dflash_queue.config import Config, load_config
from dflash_queue.live.epochs import start_epoch
from dflash_queue.runstate.audits import AuditRecords, Suspect, member
from dflash_queue.runstate.ledger import Ledger, resilient_client
from dflash_queue.runstate.shard_states import DONE, FAILED
from dflash_queue.runstate.window import ShardWindow, epoch_states
from dflash_queue.shards.consumed import ConsumedShard
from dflash_queue.shards.keys import consumed_key, epoch_shard_key, epoch_shards_prefix, shard_id_of
from dflash_queue.shards.ranges import open_source
from dflash_queue.shards.reader import ShardIndex
from dflash_queue.storage import Storage, open_storage
from dflash_queue.training import ShardDataset, SuspectShardError, collate_padded

log = logging.getLogger(__name__)


class LiveShard(ShardDataset):
    """One training shard of a live run: a ShardDataset, and which epoch and shard it is."""

    epoch: int
    shard_id: str


def _distributed_rank() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class LiveShards:
    """An iterable of a running job's training shards (each a `LiveShard`), for one rank of one consumer."""

    def __init__(
        self,
        config: Config | str | os.PathLike[str],
        *,
        consumer: str = "trainer",
        rank: int | None = None,
        world_size: int | None = None,
        epochs: int = 1,
        seed: int = 0,
        poll_s: float = 1.0,
        start_epochs: bool = True,
        run_wait_s: float = 60.0,
        **dataset_options: Any,
    ) -> None:
        """`rank`/`world_size`: default torch.distributed's when it is initialized, else RANK/WORLD_SIZE, else 0/1.
        `epochs`: how many epochs to serve (later ones re-extracted, see `dflash-queue epoch`); `start_epochs`:
        start them when due (else an operator does). With an empty broker.url the broker is that of the
        `dflash-queue run` running the job, waited for up to `run_wait_s`. `dataset_options` go to each
        ShardDataset (`hidden_dtype`, `finish_reasons`, `drop_flagged`, ...)."""
        config = config if isinstance(config, Config) else load_config(Path(config))
        if not config.broker.url:
            config = running_broker(config, wait_s=run_wait_s)
        self.config = config
        found_rank, found_world = _distributed_rank()
        self.rank = found_rank if rank is None else rank
        self.world_size = found_world if world_size is None else world_size
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not within world size {self.world_size}")
        if epochs < 1:
            raise ValueError(f"epochs must be at least 1, got {epochs}")
        window = self.config.extract.max_unconsumed_shards
        if window and window < self.world_size:
            raise ValueError(
                f"extract.max_unconsumed_shards ({window}) is below the world size ({self.world_size}): each rank "
                "waits on a shard of its own, and ranks that train in step would wait on each other for ever"
            )
        self.consumer = consumer
        self.epochs = epochs
        self.seed = seed
        self.poll_s = poll_s
        self.start_epochs = start_epochs
        self.dataset_options = dataset_options
        # Shards of each epoch left out because their extraction failed for good (their dead letters say why).
        self.failed: dict[int, list[str]] = {}
        # Shards of each epoch waiting to be extracted again because they are suspect (shard id -> why).
        self.suspect: dict[int, dict[str, str]] = {}
        self._pid = -1
        self._registered = False
        self._gone: set[str] = set()  # shards deleted before this consumer registered
        # Registered at once: a shard is deleted only once every consumer registered has acknowledged it.
        self._connect()

    # -- process-local connections (a DataLoader worker opens its own)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_consumption", "_ledger", "_storage", "_audits", "_given_back"):
            state.pop(name, None)
        state["_pid"] = -1
        return state

    def _connect(self) -> None:
        if self._pid == os.getpid():
            return
        client = resilient_client(self.config.broker.connection_url())
        self._consumption = ShardWindow(client, self.config.run.name)
        self._ledger = Ledger(client, self.config.run.name)
        self._audits = AuditRecords(client, self.config.run.name)
        self._storage: Storage = open_storage(self.config.storage)
        # Suspect shards whose place in the window this process gave back.
        self._given_back: set[tuple[int, str]] = set()
        self._pid = os.getpid()
        if not self._registered:
            self._consumption.register(self.consumer, world_size=self.world_size, seed=self.seed)
            self._consumption.want_epochs(self.consumer, self.epochs)
            self._registered = True

    @property
    def consumption(self) -> ShardWindow:
        self._connect()
        return self._consumption

    # -- iteration

    def __iter__(self) -> Iterator[LiveShard]:
        for epoch in range(self.epochs):
            yield from self.epoch(epoch)

    def mine(self, position: int, part: tuple[int, int] = (0, 1)) -> bool:
        """Whether the shard stored `position`-th in its epoch is this rank's (and this part's of it)."""
        index, count = part
        return position % self.world_size == self.rank and (position // self.world_size) % count == index

    @overload
    def epoch(self, epoch: int, *, part: tuple[int, int] = ..., idle: Literal[False] = ...) -> Iterator[LiveShard]: ...

    @overload
    def epoch(self, epoch: int, *, part: tuple[int, int] = ..., idle: bool) -> Iterator[LiveShard | None]: ...

    def epoch(self, epoch: int, *, part: tuple[int, int] = (0, 1), idle: bool = False) -> Iterator[LiveShard | None]:
        """This rank's shards of `epoch` not yet acknowledged, each as soon as it is stored. `part` (index, count)
        takes every count-th of them (a DataLoader worker's share); `idle`: None is yielded each time it is about
        to wait for a shard."""
        self._connect()
        total = len(self._wait_sealed(epoch))
        acknowledged = self._acknowledged(epoch)
        positions: dict[str, int] = {}
        remaining: list[str] = []
        finished_interrupted = False
        while True:
            self._consumption.seen(self.consumer, self.rank, epoch)
            for shard_id, position in self._consumption.stored_since(epoch, len(positions)):
                positions[shard_id] = position
                if self.mine(position, part) and shard_id not in acknowledged:
                    remaining.append(shard_id)
            if not finished_interrupted:
                mine = {s for s, position in positions.items() if self.mine(position, part)}
                self._finish_interrupted(epoch, acknowledged & mine)
                finished_interrupted = True
            served = False
            for shard_id in list(remaining):
                shard = self._open(epoch, shard_id)
                if shard is not None or shard_id in self._gone:
                    remaining.remove(shard_id)
                if shard is not None:
                    served = True
                    yield shard
            if served:
                continue
            for shard_id in self._failed_again(epoch, remaining):
                remaining.remove(shard_id)
            if not remaining and len(positions) + len(self._failed(epoch, positions)) >= total:
                break
            self._start_due(epoch + 1)
            if idle:
                yield None
            time.sleep(self.poll_s)
        self._start_due(epoch + 1)
        if epoch == self.epochs - 1:
            self._consumption.part_finished(self.consumer, self.rank, part)

    def samples(
        self, batch_size: int, collate_fn: Callable[[list[dict[str, Any]]], Any] = collate_padded
    ) -> LiveSamples:
        """The rank's samples in batches, an IterableDataset for a DataLoader with workers (see LiveSamples)."""
        return LiveSamples(self, batch_size, collate_fn)

    # -- acknowledgement

    def ack(self, shard: LiveShard) -> None:
        self.acknowledge(shard.epoch, shard.shard_id)

    def acknowledge(self, epoch: int, shard_id: str) -> None:
        """The shard is consumed by this consumer. Once every registered consumer has it, its place in the window
        is given back and (storage.retention = "until-consumed") its file deleted, its samples recorded."""
        self._connect()
        everyone = self._consumption.acknowledge(self.consumer, epoch, shard_id)
        self._note_if_suspect(epoch, shard_id)
        if everyone:
            self._release(epoch, shard_id)

    def _release(self, epoch: int, shard_id: str) -> None:
        if self.config.storage.retention == "until-consumed":
            self._delete(epoch, shard_id)
        self._consumption.give_back_place(epoch, shard_id)

    def _finish_interrupted(self, epoch: int, acknowledged: set[str]) -> None:
        """A rank killed between an acknowledgement and what follows it (the file's deletion, the place given
        back) finishes that when it starts again."""
        unfinished = self._consumption.places_held(epoch, sorted(acknowledged))
        if self.config.storage.retention == "until-consumed":
            stored = {shard_id_of(key) for key in self._storage.list(epoch_shards_prefix(epoch))}
            unfinished |= acknowledged & stored
        for shard_id in sorted(unfinished):
            if self._consumption.everyone_acknowledged(epoch, shard_id):
                self._release(epoch, shard_id)

    def consumed(self, batch: Mapping[str, Any] | Sequence[Mapping[str, Any]]) -> list[tuple[int, str]]:
        """Count a batch from `samples()` as consumed; acknowledges each shard whose samples all were. Returns the
        (epoch, shard id) of each shard acknowledged."""
        items: list[tuple[int, str, int]]
        if isinstance(batch, Mapping):
            items = list(zip(batch["epoch"], batch["shard_id"], batch["shard_samples"], strict=True))
        else:
            items = [(item["epoch"], item["shard_id"], item["shard_samples"]) for item in batch]
        counts = self.__dict__.setdefault("_counts", Counter())
        acked = []
        for epoch, shard_id, total in items:
            key = (int(epoch), shard_id)
            counts[key] += 1
            if counts[key] == int(total):
                del counts[key]
                self.acknowledge(int(epoch), shard_id)
                acked.append(key)
        return acked

    # -- helpers

    def _failed(self, epoch: int, stored: Mapping[str, int]) -> list[str]:
        """The epoch's shards whose extraction failed for good (left out); a done shard stored before its position
        was recorded gets one now."""
        shards = self._consumption.epoch_shards(epoch) or {}
        unstored = [s for s in shards if s not in stored]
        states = epoch_states(self._consumption, self._ledger, epoch, unstored)
        for shard_id in unstored:
            if states.get(shard_id) == DONE:
                self._consumption.record_stored(epoch, shard_id)
        failed = sorted(s for s in unstored if states.get(s) == FAILED)
        known = self.failed.setdefault(epoch, [])
        for shard_id in failed:
            if shard_id not in known:
                known.append(shard_id)
                log.warning("epoch %d: shard %s failed to extract; left out (see `dflash-queue dead`)", epoch, shard_id)
        return failed

    def _acknowledged(self, epoch: int) -> set[str]:
        return self._consumption.acknowledged(self.consumer, epoch)

    def _wait_sealed(self, epoch: int) -> dict[str, int]:
        self._connect()
        while True:
            shards = self._consumption.epoch_shards(epoch)
            if shards is not None:
                return shards
            self._start_due(epoch)
            time.sleep(self.poll_s)

    def _start_due(self, epoch: int) -> None:
        """Start `epoch` if it is one this consumer wants and the previous one's extraction is over."""
        if not self.start_epochs or not 0 < epoch < self.epochs or self._consumption.epoch_shards(epoch) is not None:
            return
        report = start_epoch(
            self.config, epoch, seed=self.seed, consumption=self._consumption, ledger=self._ledger
        )
        if report.started:
            log.info("%s", "; ".join(report.lines()))

    # -- suspect shards

    def _suspect_waits(self, epoch: int, shard_id: str, why: str) -> None:
        """A suspect shard of this rank's: not read; its place in the window given back (once), so that suspect
        shards never fill the window; served once it is stored anew."""
        if (epoch, shard_id) not in self._given_back:
            self._consumption.give_back_place(epoch, shard_id)
            self._given_back.add((epoch, shard_id))
        waiting = self.suspect.setdefault(epoch, {})
        if shard_id not in waiting:
            waiting[shard_id] = why
            log.warning(
                "epoch %d: shard %s is suspect (%s); not read: served once it is extracted again "
                "(`dflash-queue suspects reextract`)", epoch, shard_id, why,
            )

    def _failed_again(self, epoch: int, remaining: Sequence[str]) -> list[str]:
        """Suspect shards of `remaining` whose extraction again failed for good: left out, as failed ones are."""
        waiting = self.suspect.get(epoch, {})
        candidates = [s for s in remaining if s in waiting]
        if not candidates:
            return []
        states = epoch_states(self._consumption, self._ledger, epoch, candidates)
        failed = [s for s in candidates if states.get(s) == FAILED]
        known = self.failed.setdefault(epoch, [])
        for shard_id in failed:
            del waiting[shard_id]
            if shard_id not in known:
                known.append(shard_id)
            log.warning("epoch %d: suspect shard %s failed to extract again; left out (see `dflash-queue dead`)",
                        epoch, shard_id)
        return failed

    def _note_if_suspect(self, epoch: int, shard_id: str) -> None:
        """A shard acknowledged after it turned suspect was served before: this consumer joins those the suspect
        names as having consumed it."""
        text = self._audits.client.hget(self._audits.keys.suspects, member(shard_id, epoch))
        if not text:
            return
        suspect = Suspect.from_json(text)
        if self.consumer not in suspect.consumed_by:
            self._audits.note_consumed(suspect, [*suspect.consumed_by, self.consumer])

    def _open(self, epoch: int, shard_id: str) -> LiveShard | None:
        key = epoch_shard_key(shard_id, epoch)
        if self._audits.is_suspect(shard_id, epoch):  # the broker's word comes before the storage mark's
            text = self._audits.client.hget(self._audits.keys.suspects, member(shard_id, epoch)) or "{}"
            self._suspect_waits(epoch, shard_id, Suspect.from_json(text).reason or "suspect")
            return None
        try:
            shard = LiveShard(
                self._storage, keys=[key], on_bad_shard="raise", on_suspect_shard="raise", **self.dataset_options
            )
        except SuspectShardError as exc:
            self._suspect_waits(epoch, shard_id, "; ".join(mark.reason for mark in exc.marks.values()))
            return None
        except FileNotFoundError:
            shard = None
        except Exception as exc:
            if not self._storage.exists(key):
                shard = None
            else:
                raise exc
        if shard is None:
            if self._storage.exists(consumed_key(shard_id, epoch)):
                # Every consumer registered then took it before this one registered: it is gone.
                warnings.warn(
                    f"epoch {epoch}: shard {shard_id} was consumed and deleted before consumer {self.consumer!r} "
                    "registered; left out",
                    stacklevel=3,
                )
                self._consumption.acknowledge(self.consumer, epoch, shard_id)
                self._gone.add(shard_id)
            return None  # done in the ledger, not yet in storage: looked for again
        self.suspect.get(epoch, {}).pop(shard_id, None)
        self._given_back.discard((epoch, shard_id))
        shard.epoch = epoch
        shard.shard_id = shard_id
        shard._storage_url = self.config.storage  # type: ignore[assignment]  # reopened from it in another process
        return shard

    def _delete(self, epoch: int, shard_id: str) -> None:
        key = epoch_shard_key(shard_id, epoch)
        if not self._storage.exists(key):
            return
        source = open_source(self._storage, key)
        try:
            index = ShardIndex.load(source)
        finally:
            source.close()
        record = ConsumedShard.of(index, shard_id, epoch, list(self._consumption.consumers()))
        self._storage.write_bytes(consumed_key(shard_id, epoch), record.to_json())
        self._storage.delete(key)


class LiveSamples(IterableDataset):
    """Batches of a rank's samples, for a DataLoader with workers (`DataLoader(live.samples(8), batch_size=None,
    num_workers=2, in_order=False)`): each worker serves every num_workers-th of the rank's shards of each epoch,
    `batch_size` samples a batch, a part batch as soon as no shard is ready (a batch that waited for the next shard
    would keep the window full for ever). Items are ShardDataset items with `epoch`, `shard_id` and
    `shard_samples` (the shard's samples after the filters) added, collated by `collate_fn`; pass each batch to
    `LiveShards.consumed` after the step. Keep extract.max_unconsumed_shards at least ranks x loader workers."""

    def __init__(self, live: LiveShards, batch_size: int, collate_fn: Callable[[list[dict[str, Any]]], Any]) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, got {batch_size}")
        self.live = live
        self.batch_size = batch_size
        self.collate_fn = collate_fn

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        part = (info.id, info.num_workers) if info is not None else (0, 1)
        items: list[dict[str, Any]] = []
        for epoch in range(self.live.epochs):
            for shard in self.live.epoch(epoch, part=part, idle=True):
                if shard is None:  # about to wait for a shard: what is here goes now
                    if items:
                        yield self.collate_fn(items)
                        items = []
                    continue
                if len(shard) == 0:
                    self.live.ack(shard)  # nothing to consume
                    continue
                for i in range(len(shard)):
                    item = shard[i]
                    item.update(epoch=epoch, shard_id=shard.shard_id, shard_samples=len(shard))
                    items.append(item)
                    if len(items) == self.batch_size:
                        yield self.collate_fn(items)
                        items = []
        if items:
            yield self.collate_fn(items)
