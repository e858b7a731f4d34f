"""Audit lane: stored training shard in, verdict out. Samples of the shard are recomputed from their stored token
ids by the checkpoint's own class, one decoder layer resident at a time (engines/reference/streamed.py), and
compared with the states stored for them, at every stored entry (engines/reference/check.py: per token and per
sequence, against what the checkpoint's own class differs by in the engine's dtype, as stored).

It shares nothing with the extract engines but the checkpoint, so it sees what their own checks cannot: an error the
same batched and alone (the canary's blind spot), in a layer the load-time probe did not reach, past the prefill
step of a long sequence. It runs off the extract lane's path, on the audit workers' cores or GPU; the extract task
step sends it the shards that are due (queue/steps/audit_handoff.py): each extract worker process's first shard,
then one in `audit.every_shards`, and one every `audit.every_minutes`.

A mismatch is not a failed task: the audit did its job. Its verdict, in the broker (runstate/audits.py), halts the
extract worker process that stored the shard (it stops with exit 78: queue/audit_halt.py) and makes suspect every
shard it stored since its last passed audit; each suspect shard gets a mark in storage (shards/suspects.py), which
every reader checks, and its record names the consumers that had already taken it. `dflash-queue suspects
reextract` sends them to the extract lane again once the engine is fixed.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from dflash_queue.config import BrokerConfig, Config
from dflash_queue.engines.devices import resolve_dtype
from dflash_queue.engines.reference.check import compare_with_truth, reference_truth
from dflash_queue.engines.reference.streamed import StreamedDecoder
from dflash_queue.lanes.config import AuditConfig
from dflash_queue.runstate.audits import AuditRecords, StoredShard, Suspect
from dflash_queue.runstate.ledger import resilient_client
from dflash_queue.runstate.window import ShardWindow
from dflash_queue.shards.keys import epoch_shard_key
from dflash_queue.shards.ranges import open_source
from dflash_queue.shards.reader import ShardIndex, read_sample
from dflash_queue.shards.suspects import SuspectMark, mark_suspect
from dflash_queue.storage import Storage, open_storage
from dflash_queue.storage.config import StorageConfig

log = logging.getLogger(__name__)

@dataclass(frozen=True)
class AuditSummary:
    shard_id: str
    epoch: int
    samples: int = 0
    tokens: int = 0
    passed: bool = True
    detail: str = ""
    excess: float = 0.0  # the audited states' distance to their bounds (above 1: beyond them)
    suspects: tuple[str, ...] = ()  # shards made suspect by this audit
    skipped: bool = False
    poisoned: tuple[tuple[str, BaseException], ...] = ()

    def counters(self) -> dict[str, int]:
        return {
            "audit_samples": self.samples,
            "audit_tokens": self.tokens,
            "audit_failed": int(not self.passed),
            "audit_suspects": len(self.suspects),
            "audit_shards": 1,
        }

    def maxima(self) -> dict[str, float]:
        return {} if self.skipped else {"audit_excess": self.excess}

    @property
    def handed_on(self) -> int:
        return 0

    def describe(self) -> str:
        if self.skipped:
            return f"audit of shard {self.shard_id} (epoch {self.epoch}): {self.detail or 'already audited'}"
        verdict = "passed" if self.passed else f"FAILED, {len(self.suspects)} shard(s) made suspect"
        return f"audit of shard {self.shard_id} (epoch {self.epoch}): {verdict}: {self.detail}"


@dataclass(frozen=True)
class AuditLaneSettings:
    """What the audit lane reads of the configuration (`audit_lane_settings` takes it from a whole Config)."""

    audit: AuditConfig
    storage: StorageConfig
    model_path: str
    # What the extract engine computes in when a stored shard's record does not say ("auto" resolved on the
    # extract workers' device kind, which the audit worker may not share).
    engine_dtype: str
    hidden_dtype: str
    open_records: Callable[[], AuditRecords]
    open_window: Callable[[], ShardWindow]


class AuditLane:
    def __init__(self, settings: AuditLaneSettings, storage: Storage | None = None) -> None:
        self.settings = settings
        self._owns_storage = storage is None
        self.storage = storage or open_storage(settings.storage)
        device = settings.audit.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.decoder = StreamedDecoder(settings.model_path, device=device)
        self.records = settings.open_records()
        self._window: ShardWindow | None = None
        log.info("audit lane: the checkpoint's own %s, one decoder layer at a time on %s (%d layers)",
                 self.decoder.layout.model_type, self.decoder.device, self.decoder.num_layers)

    def already_stored(self, shard_id: str, *, epoch: int = 0) -> AuditSummary | None:
        """A shard whose audit has a verdict already (a re-delivered task) is not audited again."""
        stored = self.records.stored_shard(shard_id, epoch)
        if stored is not None and stored.verdict:
            return AuditSummary(shard_id, epoch, skipped=True, passed=stored.verdict == "passed",
                                detail=f"already audited: {stored.verdict}")
        return None

    def run(self, shard_id: str, *, redo: bool = False, epoch: int = 0) -> AuditSummary:
        key = epoch_shard_key(shard_id, epoch)
        if not self.storage.exists(key):  # consumed and deleted (storage.retention), or never stored
            return AuditSummary(shard_id, epoch, skipped=True, detail=f"{key} is not in storage: nothing to audit")
        stored = self.records.stored_shard(shard_id, epoch)
        source = open_source(self.storage, key)
        try:
            index = ShardIndex.load(source)
            rows = audited_rows(index, shard_id, self.settings.audit.samples_per_shard)
            read = [read_sample(index, source, row, torch.float32) for row in rows]
        finally:
            source.close()
        captured = list(zip(index.layer_ids, index.layer_states or ("decoder_output",) * len(index.layer_ids)))
        sequences = [sample["input_ids"].tolist() for sample in read]
        # What the engine computed in, as the worker that stored the shard said; else the config's.
        dtype = resolve_dtype((stored.dtype if stored else "") or self.settings.engine_dtype, self.decoder.device)
        truth = reference_truth(self.decoder, sequences, captured, dtype, stored=index.dtype)
        comparison = compare_with_truth([sample["hidden_states"] for sample in read], truth, captured)
        names = ", ".join(f"{index.sample_ids[row]} ({len(seq)} tokens)" for row, seq in zip(rows, sequences))
        detail = f"samples {names}: {comparison.describe()}"
        if comparison.agrees:
            if stored is not None:
                self.records.record_passed(stored, detail)
            log.info("audit of shard %s passed: %s", shard_id, detail)
            return AuditSummary(shard_id, epoch, len(rows), comparison.tokens, True, detail,
                                comparison.worst.excess)
        worst = comparison.worst
        sequence, _ = worst.worst_token
        reason = (
            f"audit of shard {shard_id}: sample {index.sample_ids[rows[sequence]]}, layer {worst.name}: "
            f"{worst.describe()} against the checkpoint's own forward"
        )
        suspects = self._suspect(stored, shard_id, epoch, reason)
        log.error("%s: %s; %d shard(s) made suspect: %s", reason, detail, len(suspects),
                  ", ".join(s.shard for s in suspects))
        return AuditSummary(shard_id, epoch, len(rows), comparison.tokens, False, f"{reason}; {detail}",
                            worst.excess, tuple(s.shard for s in suspects))

    def _suspect(self, stored: StoredShard | None, shard_id: str, epoch: int, reason: str) -> list[Suspect]:
        """The failed audit's consequences: the storing worker halted and its unchecked shards suspect (only this
        shard when the broker does not know who stored it), each marked in storage with who had consumed it."""
        if stored is None:
            suspects = [self.records.add_suspect(Suspect(shard_id, epoch, "", "?", reason, shard_id, 0.0))]
        else:
            suspects = self.records.record_failed(stored, reason)
        window = self._consumption()
        consumers = list(window.consumers())
        noted = []
        for suspect in suspects:
            by = [c for c in consumers if suspect.shard in window.acknowledged(c, suspect.epoch)]
            if by:
                suspect = self.records.note_consumed(suspect, by)
            mark_suspect(self.storage, SuspectMark(suspect.shard, suspect.epoch, reason, suspect.audited,
                                                   suspect.node, suspect.time))
            noted.append(suspect)
        return noted

    def _consumption(self) -> ShardWindow:
        if self._window is None:
            self._window = self.settings.open_window()
        return self._window

    def close(self) -> None:
        if self._owns_storage and hasattr(self.storage, "close"):
            self.storage.close()


def audited_rows(index: ShardIndex, shard_id: str, count: int) -> list[int]:
    """Which of the shard's sequences are recomputed, drawn from the shard id (a re-delivery checks the same): in
    every other shard its longest first, then at random."""
    lengths = [end - start for start, end in (index.rows(i) for i in range(len(index)))]
    order = list(range(len(lengths)))
    random.Random(shard_id).shuffle(order)
    chosen: list[int] = []
    if hashlib.sha256(shard_id.encode()).digest()[0] % 2 == 0:
        chosen.append(max(range(len(lengths)), key=lambda i: (lengths[i], -i)))
    chosen += [i for i in order if i not in chosen]
    return chosen[: max(1, count)]


def audit_lane_settings(config: Config) -> AuditLaneSettings:
    """What the audit lane reads, taken from the whole configuration."""
    extract = config.extract
    engine_dtype = (extract.vllm.dtype or config.model.dtype) if extract.engine == "vllm" else config.model.dtype
    return AuditLaneSettings(
        audit=config.audit,
        storage=config.storage,
        model_path=config.model.path,
        engine_dtype=engine_dtype,
        hidden_dtype=extract.hidden_dtype,
        open_records=functools.partial(_open_records, config.broker, config.run.name),
        open_window=functools.partial(_open_window, config.broker, config.run.name),
    )


def _open_records(broker: BrokerConfig, run_name: str) -> AuditRecords:
    return AuditRecords(resilient_client(broker.connection_url()), run_name)


def _open_window(broker: BrokerConfig, run_name: str) -> ShardWindow:
    return ShardWindow.from_url(broker.connection_url(), run_name)


def build_audit_lane(config: Config, storage: Storage | None = None) -> Any:
    return AuditLane(audit_lane_settings(config), storage)
