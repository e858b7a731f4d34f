"""Extract lane: completions shard in, training shard out (hidden states at the configured layers).

The engine is the Transformers model (engines/hf/extract.py) or a vLLM engine (engines/vllm/extract.py), chosen
by `extract.engine`; both hand over the same states, and the shard's `extraction` metadata says which made it.

Keeping the engine busy while shards are stored: the extract worker runs its tasks in Celery's threads pool
with several task slots (the engine's compute slots + storage.uploader.max_pending by default), and a task
acknowledges only after its shard is durably stored. A task first takes a slot in the uploader's bounded staging
area (back-pressure: when uploads fall behind, tasks wait there rather than filling the disk), then one of the
lane's compute slots (one task on the Transformers model at a time; `extract.vllm.inflight_tasks` on the vLLM
engine, which batches across them). Its hidden states go to the staged file as each forward pass finishes
(shards/training_writer.py), so a task holds about one pass of states in host memory, never its shard; the
header is written and the upload waited for after the compute slot is released, so while one task waits for its
shard to reach storage, the next task already computes. One task per shard keeps re-delivery simple: a shard is
either stored whole or computed again.

Every shard is checked before it is written (see engines/state_checks.py): `extract.canary_samples` samples,
chosen from the shard id, are recomputed alone (through the model's own attention, or as a batch of one through
the vLLM engine) and compared with their states from the shared pass, and every sample's layers are checked for states no forward pass gives. Either failing fails the task
for good: its dead letter names the sample, the layer and the error, and nothing wrong is stored. A canary
mismatch is first checked again with both sides recomputed (the shard's pass, stored over the first one, and the
sample alone): a one-off flake does not cost the shard.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import safetensors
import torch
import transformers

import dflash_queue
from dflash_queue import faults
from dflash_queue.config import BrokerConfig, Config
from dflash_queue.engines.base import CapturedStates, ExtractEngine, ExtractionRequest
from dflash_queue.engines.state_checks import CanaryTolerance, check_plausible
from dflash_queue.engines.vllm.support import VllmExtractSettings
from dflash_queue.errors import WindowFull, WorkerShuttingDown
from dflash_queue.lanes.canaries import CanaryPicker, run_canary
from dflash_queue.lanes.config import ExtractConfig
from dflash_queue.lanes.host_memory import fix_mmap_threshold
from dflash_queue.lanes.isolation import run_isolating_streamed
from dflash_queue.runstate.shard_states import CANARY_ERROR
from dflash_queue.runstate.window import TAKEN, ShardWindow
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.consumed import ConsumedShard
from dflash_queue.shards.keys import completions_key, consumed_key, epoch_shard_key, prompts_key
from dflash_queue.shards.prompts import decode_prompts
from dflash_queue.shards.ranges import open_source
from dflash_queue.shards.reader import ShardIndex
from dflash_queue.shards.training import ShardInfo
from dflash_queue.shards.training_writer import ShardRow, TrainingShardWriter
from dflash_queue.storage import Storage, open_storage
from dflash_queue.storage.config import StorageConfig
from dflash_queue.storage.uploader import ShardUploader

# How long a task waits for a place in the window before it goes back to the queue (well within any visibility
# timeout), and how often it looks.
WINDOW_WAIT_S = 20.0
WINDOW_POLL_S = 1.0


@dataclass(frozen=True)
class ExtractSummary:
    shard_id: str
    num_samples: int
    num_tokens: int
    num_bytes: int
    skipped: bool = False
    # (sample id, error) of each sample isolated as the cause of an engine failure: left out of the shard.
    poisoned: tuple[tuple[str, BaseException], ...] = ()
    # Canary samples recomputed alone, and their worst relative error against the packed states (None: none).
    canary_samples: int = 0
    canary_error: float | None = None
    # The canary could not see a leak between sequences (none of its samples followed another in its pass).
    canary_untestable: bool = False
    # The canary also checked a sequence longer than the model's sliding window or attention chunk.
    canary_window: bool = False

    def counters(self) -> dict[str, int]:
        return {
            "extract_canary_samples": self.canary_samples,
            "extract_canary_untestable": int(self.canary_untestable),
            "extract_canary_window": int(self.canary_window),
            "extract_samples": self.num_samples,
            "extract_tokens": self.num_tokens,
            "extract_bytes": self.num_bytes,
            "extract_shards": 1,
        }

    def maxima(self) -> dict[str, float]:
        return {} if self.canary_error is None else {CANARY_ERROR: self.canary_error}

    @property
    def handed_on(self) -> int:
        return self.num_samples

    def describe(self) -> str:
        return (
            f"extracted shard {self.shard_id}: {self.num_samples} samples, {self.num_tokens} tokens, "
            f"{self.num_bytes} bytes"
            + (f"; canary relative error {self.canary_error:.2e}" if self.canary_error is not None else "")
            + (f"; {len(self.poisoned)} dead-lettered" if self.poisoned else "")
            + (" (already stored)" if self.skipped else "")
        )


def versions(engine: str = "transformers") -> dict[str, str]:
    found = {
        "dflash_queue": dflash_queue.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
    }
    if engine == "vllm":
        import vllm

        found["vllm"] = vllm.__version__
    return found


@dataclass(frozen=True)
class ExtractLaneSettings:
    """What the extract lane reads of the configuration (`extract_lane_settings` takes it from a whole Config)."""

    extract: ExtractConfig
    storage: StorageConfig  # opened when the lane is handed no storage; its uploader and retention
    staging_dir: Path  # where finished shards are staged before they are stored
    # The window's state in the run's broker, reached when a window is first used (the broker's password is read
    # then, as before any connection), and the broker's visibility timeout, which bounds a wait for a place.
    open_window: Callable[[], ShardWindow]
    visibility_timeout_s: float
    # Recorded in every shard: the target's name, the run's fingerprint, the vLLM engine_args that change outputs.
    target_model: str
    fingerprint: str
    engine_args: dict[str, dict[str, Any]]


class ExtractLane:
    def __init__(
        self,
        settings: ExtractLaneSettings,
        extractor: ExtractEngine,
        storage: Storage | None = None,
        uploader: ShardUploader | None = None,
    ) -> None:
        self.settings = settings
        self.extractor = extractor
        self._owns_storage = storage is None
        self.storage = storage or open_storage(settings.storage)
        self.uploader = uploader or ShardUploader.from_settings(
            settings.storage.uploader, settings.staging_dir, self.storage
        )
        self.info = ShardInfo(
            target_model=settings.target_model,
            layer_ids=tuple(layer for layer, _ in extractor.captured),
            layer_states=tuple(kind for _, kind in extractor.captured),
            extraction=extractor.mode,
            num_model_layers=extractor.num_model_layers,
            hidden_size=extractor.hidden_size,
            dtype=settings.extract.hidden_dtype,
            config_fingerprint=settings.fingerprint,
            engine_args=settings.engine_args,
            versions=versions(extractor.name),
        )
        self._canary_tolerance()  # a configured tolerance above the dtype's ceiling is refused here, at load
        self._compute = threading.Semaphore(extractor.concurrent_tasks)
        self._stopping = threading.Event()
        self._consumption: ShardWindow | None = None  # the window's state, reached once there is one

    def run(self, shard_id: str, *, redo: bool = False, epoch: int = 0) -> ExtractSummary:
        """Extract one shard for `epoch` and return once it is durably stored. Safe to call from several threads.

        The lane task asks `already_stored` first, unless `redo` (a requeued dead letter: the shard is written
        again, whole). With a window (extract.max_unconsumed_shards) the shard first takes a place in it, or raises
        WindowFull after a short wait; a place taken now is followed by a second look (`already_stored`).
        """
        out_key = epoch_shard_key(shard_id, epoch)
        if self._take_place(shard_id, epoch) and not redo:
            # Another delivery of this shard's task (a message delivered twice) may have stored it, and its
            # consumers taken it and given its place back, while this one waited: the place taken now would then
            # never be given back (a place lost to the window for good).
            reused = self.already_stored(shard_id, epoch=epoch)
            if reused is not None:
                self._give_back_place(shard_id, epoch)
                return reused
        in_key = completions_key(shard_id)
        records = decode_completions(self.storage.read_bytes(in_key), what=in_key)
        # Samples the quality gate dropped are accounted for in the shard's metadata, never extracted.
        kept = [r for r in records if r.kept]
        dropped = [(r.id, r.quality) for r in records if not r.kept]
        # A sample stored as one sequence per turn is several requests of the same id.
        sequences = [(record, sequence) for record in kept for sequence in record.training_sequences()]
        requests = [ExtractionRequest(record.id, sequence.input_ids) for record, sequence in sequences]
        rows = [
            ShardRow(
                id=record.id,
                input_ids=torch.tensor(sequence.input_ids, dtype=torch.int32),
                loss_mask=torch.tensor(sequence.loss_mask, dtype=torch.uint8),
                finish_reason=sequence.finish_reason,
                thinking=record.thinking,
                quality=record.quality,
                turn=sequence.turn,
            )
            for record, sequence in sequences
        ]
        summaries: dict[int, torch.Tensor] = {}
        picker = CanaryPicker(
            shard_id,
            [len(r.input_ids) for r in requests],
            self.settings.extract.canary_samples,
            self.settings.extract.canary_longest_every,
        )
        with self.uploader.stage(shard_id) as staged:
            # States go to the staged file as each forward pass finishes: the task holds about one pass of them.
            info = replace(self.info, injected_faults=faults.installed())
            with TrainingShardWriter(staged.path, rows, info, dropped=dropped) as writer:  # type: ignore[arg-type]

                def deliver(index: int, captured: CapturedStates) -> None:
                    writer.write(index, captured.states, captured.summary)
                    summaries[index] = captured.summary
                    picker.offer(index, captured.states, captured.pass_position)

                def recompute(keep: Callable[[int, torch.Tensor], None]) -> None:
                    """The canary's re-check: the shard's pass again, its states stored over the first pass's."""

                    def again(position: int, captured: CapturedStates) -> None:
                        index = ok[position]
                        writer.write(index, captured.states, captured.summary, replace=True)
                        summaries[index] = captured.summary
                        keep(index, captured.states)

                    self._capture([requests[i] for i in ok], again, shard_id=shard_id)

                with self._compute_slot(shard_id):
                    capture = functools.partial(self._capture, shard_id=shard_id)
                    isolated = run_isolating_streamed(requests, capture, [r.sample_id for r in requests], deliver)
                    poisoned_ids = {requests[i].sample_id for i, _ in isolated.poisoned}
                    ok = [i for i in isolated.ok if requests[i].sample_id not in poisoned_ids]  # whole or dead
                    canary = run_canary(
                        self.extractor, shard_id, requests, picker.chosen(ok), ok, self.layer_names,
                        self._canary_tolerance(), self.settings.extract.canary_window_every, recompute,
                        loss_masks=[row.loss_mask for row in rows], picked=picker.describe(ok),
                    )
                check_plausible(
                    [requests[i].sample_id for i in ok],
                    [summaries[i] for i in ok],
                    self.layer_names,
                    self.settings.extract.rms_outlier_factor,
                )
                first_errors: dict[str, BaseException] = {}
                for i, exc in isolated.poisoned:
                    first_errors.setdefault(requests[i].sample_id, exc)
                dead = list(first_errors)
                if not records:
                    # Every sample of the shard was dead-lettered by the generate lane: the shard records them.
                    dead = [s.id for s in decode_prompts(self.storage.read_bytes(prompts_key(shard_id)), what=shard_id)]
                kept_rows = set(ok)
                size = writer.finish(
                    dead=dead,
                    canary=canary.record if canary else None,
                    leave_out=[i for i in range(len(rows)) if i not in kept_rows],
                )
            stored = self.uploader.upload(staged, out_key)
        stored.result()
        self._drop_if_consumed(shard_id, out_key, epoch)
        return ExtractSummary(
            shard_id,
            len({rows[i].id for i in ok}),
            sum(len(requests[i].input_ids) for i in ok),
            size,
            poisoned=tuple(first_errors.items()),
            canary_samples=canary.samples if canary else 0,
            canary_error=canary.worst if canary else None,
            canary_untestable=bool(canary and canary.untestable),
            canary_window=bool(canary and canary.window),
        )

    def already_stored(self, shard_id: str, *, epoch: int = 0) -> ExtractSummary | None:
        """The summary, marked skipped, of a shard whose training file for `epoch` is stored, or was stored and
        taken by every consumer (storage.retention = "until-consumed" deleted it and left a record): it is not made
        again. None: neither."""
        out_key = epoch_shard_key(shard_id, epoch)
        if self.storage.exists(out_key):
            source = open_source(self.storage, out_key)
            try:
                index = ShardIndex.load(source)
                return ExtractSummary(shard_id, len(index), index.num_tokens, source.size(), skipped=True)
            finally:
                source.close()
        consumed = consumed_key(shard_id, epoch)
        if self.storage.exists(consumed):
            record = ConsumedShard.from_json(self.storage.read_bytes(consumed), where=consumed)
            return ExtractSummary(shard_id, len(record.samples), record.num_tokens, 0, skipped=True)
        return None

    def _window(self) -> ShardWindow:
        if self._consumption is None:
            self._consumption = self.settings.open_window()
        return self._consumption

    def _give_back_place(self, shard_id: str, epoch: int) -> None:
        self._window().give_back_place(epoch, shard_id)

    def _drop_if_consumed(self, shard_id: str, out_key: str, epoch: int) -> None:
        """A second delivery that extracted the shard while the first one's file was stored, consumed and deleted
        has just written it again: deleted again (retention = "until-consumed"), or it would stay for good."""
        if self.settings.storage.retention == "until-consumed" and self.storage.exists(consumed_key(shard_id, epoch)):
            self.storage.delete(out_key)

    def _take_place(self, shard_id: str, epoch: int) -> bool:
        """A place in the window of unconsumed shards, waited for up to WINDOW_WAIT_S (polled, not spun); whether
        it was taken now (False: no window, or the place was already held by another delivery of the task)."""
        size = self.settings.extract.max_unconsumed_shards
        if not size:
            return False
        window = self._window()
        # Well within the visibility timeout: a message held longer would be handed to another worker.
        wait_s = min(WINDOW_WAIT_S, self.settings.visibility_timeout_s / 4)
        deadline = time.monotonic() + wait_s
        while not (taken := window.take_place(epoch, shard_id, size)):
            window.note_waiting(epoch, shard_id, ttl_s=int(2 * wait_s) + 1)
            if self._stopping.wait(WINDOW_POLL_S):
                raise WorkerShuttingDown(f"shard {shard_id}: the worker is shutting down while it waits for the window")
            if time.monotonic() > deadline:
                raise WindowFull(
                    f"shard {shard_id} (epoch {epoch}): {size} shards wait for their consumers "
                    "(extract.max_unconsumed_shards); handed back to the queue"
                )
        return taken == TAKEN

    @property
    def layer_names(self) -> list[str]:
        return [f"{layer} ({kind})" for layer, kind in self.extractor.captured]

    def _capture(
        self, requests: list[ExtractionRequest], deliver: Callable[[int, CapturedStates], None], *, shard_id: str = ""
    ) -> None:
        faults.check_poison("extract", (r.sample_id for r in requests))
        with faults.extract_faults_applied(faults.extract_faults(shard_id)):
            self.extractor.capture(requests, deliver=deliver)

    def _canary_tolerance(self) -> CanaryTolerance:
        """The engine's calibrated tolerance, its whole-sample and first-token bounds fixed by
        extract.canary_tolerance when set (the per-token bound stays the calibrated one)."""
        configured = self.settings.extract.canary_tolerance
        calibrated = self.extractor.canary_tolerance()
        return calibrated.configured(configured, self.extractor.dtype) if configured else calibrated

    def begin_shutdown(self) -> None:
        """Tasks that have not reached the engine yet give up (and are requeued); the others finish."""
        self._stopping.set()

    def close(self) -> None:
        self.begin_shutdown()
        self.uploader.close()
        self.extractor.close()
        if self._owns_storage and hasattr(self.storage, "close"):
            self.storage.close()

    @contextmanager
    def _compute_slot(self, shard_id: str) -> Iterator[None]:
        """One of the engine's compute slots (one for the Transformers model, extract.vllm.inflight_tasks for the
        vLLM engine); refused once shutdown began, so that the task is requeued."""
        refused = f"shard {shard_id}: the worker is shutting down before extraction started"
        while not self._compute.acquire(timeout=0.5):
            if self._stopping.is_set():
                raise WorkerShuttingDown(refused)
        try:
            if self._stopping.is_set():
                raise WorkerShuttingDown(refused)
            yield
        finally:
            self._compute.release()


def extract_lane_settings(config: Config) -> ExtractLaneSettings:
    """What the extract lane reads, taken from the whole configuration (its fingerprint included)."""
    return ExtractLaneSettings(
        extract=config.extract,
        storage=config.storage,
        staging_dir=config.staging_dir,
        open_window=functools.partial(_open_window, config.broker, config.run.name),
        visibility_timeout_s=config.broker.visibility_timeout_s,
        target_model=config.model.display_name,
        fingerprint=config.fingerprint(),
        engine_args=config.engine_output_args(),
    )


def _open_window(broker: BrokerConfig, run_name: str) -> ShardWindow:
    return ShardWindow.from_url(broker.connection_url(), run_name)


def build_extract_lane(config: Config, storage: Storage | None = None) -> ExtractLane:
    return ExtractLane(extract_lane_settings(config), build_extractor(config), storage)


def build_extractor(config: Config) -> ExtractEngine:
    fix_mmap_threshold()  # the process that extracts keeps one pass's buffers resident, not every pass's
    if config.extract.engine == "vllm":
        from dflash_queue.engines.vllm.extract import VllmStateExtractor

        return VllmStateExtractor(vllm_extract_settings(config))
    from dflash_queue.engines.hf.extract import HiddenStateExtractor

    return HiddenStateExtractor(
        config.model.path,
        layer_ids=config.extract.layer_ids,
        num_draft_layers=config.extract.num_draft_layers,
        device=config.model.device,
        dtype=config.model.dtype,
        token_budget=config.extract.token_budget,
        attn_implementation=config.extract.attn_implementation,
        pin_memory=config.extract.pin_memory,
        packing=config.extract.packing,
        final_norm_state=config.extract.final_norm_state,
        last_layer_state=config.extract.last_layer_state,
    )


def vllm_extract_settings(config: Config) -> VllmExtractSettings:
    """What the vLLM extract engine is built from, taken from the whole configuration."""
    return VllmExtractSettings(
        model=config.model,
        extract=config.extract,
        context_len=config.extract_context_len(),
        shard_size=config.dataset.shard_size,
        canary_tolerance=config.extract.canary_tolerance,
        source=config.source,
        connector_faults=faults.vllm_states_faults(),
    )
