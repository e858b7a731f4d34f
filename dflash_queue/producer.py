"""The producer: read datasets, stage prompt shards in storage, enqueue one generate task per shard.

Re-running it is safe: a shard whose training file exists is done, and a shard the ledger shows queued or
in progress already has a message; both are skipped. Shard ids derive from sample ids, so the same dataset
always makes the same shards.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from dflash_queue.config import Config
from dflash_queue.data.problems import BadRecord, ProblemLog
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.data.thinking import apply_thinking_policy
from dflash_queue.ledger import IN_PROGRESS_OR_DONE, QUEUED, Ledger
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id
from dflash_queue.storage import Storage, open_storage
from dflash_queue.storage.keys import SHARDS, prompts_key, shard_id_of


@dataclass
class EnqueueReport:
    samples: int = 0
    duplicates: int = 0
    shards: int = 0
    enqueued: int = 0
    skipped_done: int = 0
    skipped_queued: int = 0
    shard_ids: list[str] = field(default_factory=list)
    pending_samples: int = 0
    problems: ProblemLog = field(default_factory=ProblemLog)

    def lines(self) -> list[str]:
        out = [
            f"samples: {self.samples} ({self.duplicates} exact duplicates dropped)",
            f"shards: {self.shards} ({self.enqueued} enqueued, {self.skipped_done} already done, "
            f"{self.skipped_queued} already queued)",
            f"bad records: {self.problems.total}",
        ]
        out.extend("  " + line for line in self.problems.lines())
        return out


def iter_samples(config: Config, paths: Iterable[str | Path], report: EnqueueReport) -> Iterator[Sample]:
    """Valid, de-duplicated samples with their thinking decision; bad records and duplicates are counted."""
    seen: set[str] = set()
    for item in read_dataset(paths, max_record_bytes=config.dataset.max_record_bytes):
        if isinstance(item, BadRecord):
            report.problems.add(item)
        elif item.id in seen:
            report.duplicates += 1
        else:
            seen.add(item.id)
            report.samples += 1
            yield apply_thinking_policy(item, config.dataset.thinking)


def batched(samples: Iterable[Sample], size: int) -> Iterator[list[Sample]]:
    batch: list[Sample] = []
    for sample in samples:
        batch.append(sample)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class Producer:
    def __init__(self, config: Config, ledger: Ledger, storage: Storage | None = None) -> None:
        self.config = config
        self.ledger = ledger
        self.storage = storage or open_storage(config.storage)
        self.fingerprint = config.fingerprint()

    def enqueue(
        self,
        paths: Iterable[str | Path],
        *,
        on_shard: Callable[[int], None] | None = None,
        send: Callable[[str, int, str], None] | None = None,
    ) -> EnqueueReport:
        """Stage and enqueue every shard not done or queued. `on_shard(n_samples)` reports progress."""
        send = send or _send_generate
        report = EnqueueReport()
        done = {shard_id_of(key) for key in self.storage.list(SHARDS + "/")}

        for shard in batched(iter_samples(self.config, paths, report), self.config.dataset.shard_size):
            shard_id = prompt_shard_id(shard)
            report.shards += 1
            report.shard_ids.append(shard_id)
            state = self.ledger.states([shard_id]).get(shard_id)
            if shard_id in done:
                report.skipped_done += 1
            elif state in IN_PROGRESS_OR_DONE:
                report.skipped_queued += 1
                report.pending_samples += len(shard)
            else:
                key = prompts_key(shard_id)
                if not self.storage.exists(key):
                    self.storage.write_bytes(key, encode_prompts(shard))
                send(shard_id, len(shard), self.fingerprint)
                self.ledger.set_state(shard_id, QUEUED, num_samples=len(shard))
                report.enqueued += 1
                report.pending_samples += len(shard)
            if on_shard:
                on_shard(len(shard))
        self.ledger.add({"enqueued_samples": report.samples, "bad_records": report.problems.total})
        return report


def _send_generate(shard_id: str, num_samples: int, fingerprint: str) -> None:
    from dflash_queue.queue.tasks import generate_shard

    generate_shard.apply_async(args=(shard_id, num_samples, fingerprint))
