"""Extract lane: completions shard in, training shard out (hidden states at the configured layers).

Keeping the engine busy while shards are stored: the extract worker runs its tasks in Celery's threads pool
with several task slots (1 + storage.uploader.max_pending by default), and a task acknowledges only after its
shard is durably stored. Inside `run`, only the forward passes hold the lane's compute slot (one task on the
engine at a time); reading the completions shard, writing the safetensors file and waiting for its upload happen
outside it. So while one task waits for its shard to reach storage, the next task already computes, and when
uploads fall behind, tasks queue at the uploader's bounded staging area (back-pressure) rather than on disk.
One task per shard keeps re-delivery simple: a shard is either stored whole or computed again.

Every shard is checked before it is written (see engines/state_checks.py): `extract.canary_samples` samples,
chosen from the shard id, are recomputed alone through the model's own attention and compared with their packed
states, and every sample's layers are checked for states no forward pass gives. Either failing fails the task
for good: its dead letter names the sample, the layer and the error, and nothing wrong is stored.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import safetensors
import torch
import transformers

import dflash_queue
from dflash_queue.config import Config
from dflash_queue.engines.hf_extract import CapturedStates, ExtractionRequest, HiddenStateExtractor
from dflash_queue.engines.state_checks import check_canary, check_plausible, default_tolerance
from dflash_queue import faults
from dflash_queue.errors import WorkerShuttingDown
from dflash_queue.lanes.isolation import run_isolating
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.training import ExtractedSample, ShardInfo, TrainingShard, write_training_shard
from dflash_queue.storage import Storage, open_storage
from dflash_queue.shards.prompts import decode_prompts
from dflash_queue.storage.keys import completions_key, prompts_key, shard_key
from dflash_queue.storage.uploader import ShardUploader


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

    def counters(self) -> dict[str, int]:
        return {
            "extract_canary_samples": self.canary_samples,
            "extract_samples": self.num_samples,
            "extract_tokens": self.num_tokens,
            "extract_bytes": self.num_bytes,
            "extract_shards": 1,
        }


def versions() -> dict[str, str]:
    return {
        "dflash_queue": dflash_queue.__version__,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "safetensors": safetensors.__version__,
    }


class ExtractLane:
    def __init__(
        self,
        config: Config,
        extractor: HiddenStateExtractor,
        storage: Storage | None = None,
        uploader: ShardUploader | None = None,
    ) -> None:
        self.config = config
        self.extractor = extractor
        self._owns_storage = storage is None
        self.storage = storage or open_storage(config.storage)
        self.uploader = uploader or ShardUploader.from_config(config, self.storage)
        self.info = ShardInfo(
            target_model=config.model.display_name,
            layer_ids=tuple(layer for layer, _ in extractor.captured),
            layer_states=tuple(kind for _, kind in extractor.captured),
            extraction=extractor.mode,
            num_model_layers=extractor.num_model_layers,
            hidden_size=extractor.hidden_size,
            dtype=config.extract.hidden_dtype,
            config_fingerprint=config.fingerprint(),
            versions=versions(),
        )
        self._compute = threading.Lock()
        self._stopping = threading.Event()

    def run(self, shard_id: str, *, redo: bool = False) -> ExtractSummary:
        """Extract one shard and return once it is durably stored. Safe to call from several threads.

        A stored shard is reused unless `redo` (a requeued dead letter: the shard is written again, whole).
        """
        out_key = shard_key(shard_id)
        if not redo and self.storage.exists(out_key):
            with self.storage.local_copy(out_key) as path:
                shard = TrainingShard(path)
                return ExtractSummary(shard_id, len(shard), shard.num_tokens, path.stat().st_size, skipped=True)

        in_key = completions_key(shard_id)
        records = decode_completions(self.storage.read_bytes(in_key), what=in_key)
        # Samples the quality gate dropped are accounted for in the shard's metadata, never extracted.
        kept = [r for r in records if r.kept]
        dropped = [(r.id, r.quality) for r in records if not r.kept]
        # A sample stored as one sequence per turn is several requests of the same id.
        sequences = [(record, sequence) for record in kept for sequence in record.training_sequences()]
        requests = [ExtractionRequest(record.id, sequence.input_ids) for record, sequence in sequences]
        with self._compute_slot(shard_id):
            isolated = run_isolating(requests, self._capture, [r.sample_id for r in requests])
            poisoned_ids = {requests[i].sample_id for i, _ in isolated.poisoned}
            ok = [i for i in isolated.ok if requests[i].sample_id not in poisoned_ids]  # a sample is whole or dead
            canary = self._check_canaries(shard_id, requests, isolated.results, ok)
        check_plausible(
            [requests[i].sample_id for i in ok],
            [isolated.results[i].summary for i in ok],  # type: ignore[union-attr]
            self.layer_names,
            self.config.extract.rms_outlier_factor,
        )
        samples = [
            ExtractedSample(
                id=sequences[i][0].id,
                input_ids=torch.tensor(sequences[i][1].input_ids, dtype=torch.int32),
                loss_mask=torch.tensor(sequences[i][1].loss_mask, dtype=torch.uint8),
                hidden_states=isolated.results[i].states,  # type: ignore[union-attr]
                finish_reason=sequences[i][1].finish_reason,
                thinking=sequences[i][0].thinking,
                quality=sequences[i][0].quality,
                turn=sequences[i][1].turn,
            )
            for i in ok
        ]
        first_errors: dict[str, BaseException] = {}
        for i, exc in isolated.poisoned:
            first_errors.setdefault(requests[i].sample_id, exc)
        poisoned = tuple(first_errors.items())
        dead = list(first_errors)
        if not records:
            # Every sample of the shard was dead-lettered by the generate lane: the shard records them.
            dead = [s.id for s in decode_prompts(self.storage.read_bytes(prompts_key(shard_id)), what=shard_id)]
        num_tokens = sum(len(requests[i].input_ids) for i in ok)
        del isolated
        with self.uploader.stage(shard_id) as staged:
            write_training_shard(
                staged.path, samples, self.info, dropped=dropped, dead=dead, canary=canary  # type: ignore[arg-type]
            )
            size = staged.path.stat().st_size
            num_samples = len({sample.id for sample in samples})
            del samples
            stored = self.uploader.upload(staged, out_key)
        stored.result()
        return ExtractSummary(
            shard_id,
            num_samples,
            num_tokens,
            size,
            poisoned=poisoned,
            canary_samples=len(canary["samples"]) if canary else 0,
            canary_error=canary["relative_error"] if canary else None,
        )

    @property
    def layer_names(self) -> list[str]:
        return [f"{layer} ({kind})" for layer, kind in self.extractor.captured]

    def _capture(self, requests: list[ExtractionRequest]) -> list[CapturedStates]:
        faults.check_poison("extract", (r.sample_id for r in requests))
        return self.extractor.capture(requests, break_packing=faults.packing_broken())

    def _check_canaries(
        self,
        shard_id: str,
        requests: list[ExtractionRequest],
        results: list[CapturedStates | None],
        ok: list[int],
    ) -> dict | None:
        """Recompute `extract.canary_samples` samples alone and compare; raises CanaryMismatch above tolerance.

        Drawn from the shard id, so a re-delivered task checks the same ones; preferably from the samples that
        followed another in their forward pass (the first sequence of a pass sees nothing before it, so a leak
        between sequences could not show in it) and are no longer than the shard's median, which keeps one canary
        below an average sample's cost (a sample alone computes a little less efficiently than in a pack)."""
        count = min(self.config.extract.canary_samples, len(ok))
        if not count:
            return None
        tolerance = self.config.extract.canary_tolerance or default_tolerance(self.extractor.dtype)
        lengths = {i: len(requests[i].input_ids) for i in ok}
        median = sorted(lengths.values())[(len(ok) - 1) // 2]
        followers = [i for i in ok if results[i].pass_position > 0]  # type: ignore[union-attr]
        rng = random.Random(shard_id)
        chosen: list[int] = []
        for pool in ([i for i in followers if lengths[i] <= median], followers, ok):
            fresh = [i for i in pool if i not in chosen]
            chosen += rng.sample(fresh, min(count - len(chosen), len(fresh)))
        chosen.sort()
        device = self.extractor.device
        differences = [
            check_canary(  # compared on the device: the states of a long sample are large for the host
                requests[i].sample_id,
                results[i].states.to(device),  # type: ignore[union-attr]
                self.extractor.reference_states(requests[i], on_device=True),
                self.layer_names,
                tolerance,
            )
            for i in chosen
        ]
        per_layer = [max(d.relative[k] for d in differences) for k in range(len(self.layer_names))]
        return {
            "samples": [requests[i].sample_id for i in chosen],
            "relative_error": max(per_layer),
            "relative_error_per_layer": per_layer,
            "worst_token_error": max(max(d.worst_token) for d in differences),
            "tolerance": tolerance,
        }

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
        """The engine, for one task at a time; refused once shutdown began, so that the task is requeued."""
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


def build_extractor(config: Config) -> HiddenStateExtractor:
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
    )
