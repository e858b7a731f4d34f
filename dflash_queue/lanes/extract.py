"""Extract lane: completions shard in, training shard out (hidden states at the configured layers)."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import safetensors
import torch
import transformers

import dflash_queue
from dflash_queue.config import Config
from dflash_queue.engines.hf_extract import ExtractionRequest, HiddenStateExtractor
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.training import ExtractedSample, ShardInfo, TrainingShard, write_training_shard
from dflash_queue.storage import Storage, open_storage
from dflash_queue.storage.keys import completions_key, shard_key


@dataclass(frozen=True)
class ExtractSummary:
    shard_id: str
    num_samples: int
    num_tokens: int
    num_bytes: int
    skipped: bool = False

    def counters(self) -> dict[str, int]:
        return {
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
    def __init__(self, config: Config, extractor: HiddenStateExtractor, storage: Storage | None = None) -> None:
        self.config = config
        self.extractor = extractor
        self.storage = storage or open_storage(config.storage.url)
        self.info = ShardInfo(
            target_model=config.model.display_name,
            layer_ids=tuple(extractor.layer_ids),
            num_model_layers=extractor.num_model_layers,
            hidden_size=extractor.hidden_size,
            dtype=config.extract.hidden_dtype,
            config_fingerprint=config.fingerprint(),
            versions=versions(),
        )

    def run(self, shard_id: str) -> ExtractSummary:
        out_key = shard_key(shard_id)
        if self.storage.exists(out_key):
            with self.storage.local_copy(out_key) as path:
                shard = TrainingShard(path)
                return ExtractSummary(shard_id, len(shard), shard.num_tokens, path.stat().st_size, skipped=True)

        in_key = completions_key(shard_id)
        records = decode_completions(self.storage.read_bytes(in_key), what=in_key)
        # Samples the quality gate dropped are accounted for in the shard's metadata, never extracted.
        kept = [r for r in records if r.kept]
        dropped = [(r.id, r.quality) for r in records if not r.kept]
        requests = [ExtractionRequest(r.id, r.input_ids) for r in kept]
        states = self.extractor.extract(requests) if requests else []
        samples = [
            ExtractedSample(
                id=record.id,
                input_ids=torch.tensor(request.input_ids, dtype=torch.int32),
                loss_mask=torch.tensor(record.loss_mask(), dtype=torch.uint8),
                hidden_states=hidden,
                finish_reason=record.finish_reason,
                thinking=record.thinking,
                quality=record.quality,
            )
            for record, request, hidden in zip(kept, requests, states, strict=True)
        ]
        with tempfile.TemporaryDirectory(prefix="dfq-shard-") as tmp:
            path = Path(tmp) / "shard.safetensors"
            write_training_shard(path, samples, self.info, dropped=dropped)  # type: ignore[arg-type]
            size = path.stat().st_size
            self.storage.write_file(out_key, path)
        return ExtractSummary(shard_id, len(samples), sum(len(r.input_ids) for r in requests), size)

    def close(self) -> None:
        self.extractor.close()


def build_extractor(config: Config) -> HiddenStateExtractor:
    return HiddenStateExtractor(
        config.model.path,
        layer_ids=config.extract.layer_ids,
        num_draft_layers=config.extract.num_draft_layers,
        device=config.model.device,
        dtype=config.model.dtype,
        token_budget=config.extract.token_budget,
        attn_implementation=config.extract.attn_implementation,
    )
