"""Training shards as their writer is given them, and one local shard read sample by sample (tests, audit, tools).

The format itself (tensors, metadata, names) is in training_format.py; `reader.ShardIndex` is its one parser and
checker. Here: what the extract lane hands the writer (`ExtractedSample`, `ShardInfo`, the checks made before
anything is written), and `TrainingShard`, a sample-by-sample view of one shard file through `ShardIndex`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_queue.errors import NonFiniteRowRefused, ShardFormatError
from dflash_queue.shards.fp8 import FP8_NAME
from dflash_queue.shards.ranges import LocalFileSource
from dflash_queue.shards.reader import PER_SAMPLE_KEYS, ShardIndex, read_rows, read_sample
from dflash_queue.shards.training_format import (
    DECODER_OUTPUT,
    FINAL_NORM,
    FORMAT,
    FORMAT_VERSION,
    HF_HIDDEN_STATES_INDEX,
    LAST_LAYER,
    LAYER_CONVENTION,
    LAYER_STATES,
)
from dflash_queue.shards.verdicts import Verdict

# The format's names, for the modules that import them from here.
__all__ = [
    "DECODER_OUTPUT", "FINAL_NORM", "FORMAT", "FORMAT_VERSION", "HF_HIDDEN_STATES_INDEX", "LAST_LAYER",
    "LAYER_CONVENTION", "LAYER_STATES", "ExtractedSample", "ShardInfo", "TrainingSample", "TrainingShard",
    "check_shape", "check_states", "check_summary", "validate_sample",
]


@dataclass(frozen=True)
class ExtractedSample:
    id: str
    input_ids: torch.Tensor  # int [T]
    loss_mask: torch.Tensor  # uint8 [T]
    hidden_states: torch.Tensor  # [T, K, H]
    finish_reason: str
    thinking: bool
    quality: Verdict | None = None
    # When a sample is stored as one sequence per regenerated turn: the turn this sequence ends with.
    turn: int | None = None


@dataclass(frozen=True)
class ShardInfo:
    target_model: str
    layer_ids: tuple[int, ...]
    num_model_layers: int
    hidden_size: int
    dtype: str
    config_fingerprint: str
    versions: dict[str, str]
    # One per layer id; empty means every entry is a decoder layer's output.
    layer_states: tuple[str, ...] = ()
    extraction: str = "packed"
    # Per lane run on vLLM, the engine arguments that may change its outputs (speculative decoding, quantization,
    # KV-cache dtype, ...); empty when there are none.
    engine_args: dict[str, dict[str, Any]] = field(default_factory=dict)
    # The faults the test suite had installed while the shard was made (dflash_queue/faults.py); empty in production.
    injected_faults: dict[str, Any] = field(default_factory=dict)

    def states(self) -> tuple[str, ...]:
        return self.layer_states or (DECODER_OUTPUT,) * len(self.layer_ids)

    def to_metadata(self) -> dict[str, str]:
        return {
            "format": FORMAT,
            "format_version": FORMAT_VERSION,
            "target_model": self.target_model,
            "layer_ids": json.dumps(list(self.layer_ids)),
            "layer_states": json.dumps(list(self.states())),
            "layer_convention": LAYER_CONVENTION,
            "hf_hidden_states_index": HF_HIDDEN_STATES_INDEX,
            "num_model_layers": str(self.num_model_layers),
            "hidden_size": str(self.hidden_size),
            "dtype": self.dtype,
            "config_fingerprint": self.config_fingerprint,
            "versions": json.dumps(self.versions, sort_keys=True),
            "extraction": self.extraction,
            **({"engine_args": json.dumps(self.engine_args, sort_keys=True)} if self.engine_args else {}),
            **({"injected_faults": json.dumps(self.injected_faults, sort_keys=True)} if self.injected_faults else {}),
        }


def validate_sample(sample: ExtractedSample, info: ShardInfo) -> None:
    """Lengths agree, shapes match the model, values are finite: checked before anything is written."""
    tokens = sample.input_ids.shape[0]
    if sample.loss_mask.shape[0] != tokens:
        raise ShardFormatError(f"sample {sample.id}: loss_mask has {sample.loss_mask.shape[0]} tokens, not {tokens}")
    check_states(sample.id, tokens, sample.hidden_states, info)


def check_shape(sample_id: str, tokens: int, hidden_states: torch.Tensor, info: ShardInfo) -> None:
    """One sequence's states have the shard's shape [tokens, K, H]."""
    expected = (tokens, len(info.layer_ids), info.hidden_size)
    if tuple(hidden_states.shape) != expected:
        raise ShardFormatError(
            f"sample {sample_id}: hidden_states shape {tuple(hidden_states.shape)}, expected {expected}"
        )


def check_states(sample_id: str, tokens: int, hidden_states: torch.Tensor, info: ShardInfo) -> None:
    """One sequence's states have the shard's shape and are finite, read value by value: for states that come
    without an engine's statistics (NonFiniteRowRefused: the engine's own check, which makes the samples at fault
    dead letters, was skipped)."""
    check_shape(sample_id, tokens, hidden_states, info)
    if not torch.isfinite(hidden_states).all():
        raise NonFiniteRowRefused(sample_id)


def check_summary(sample_id: str, summary: torch.Tensor | None, info: ShardInfo) -> None:
    """The statistics an engine checked one sequence's states with came with them: per captured layer [K, 3] the
    largest value, the smallest and the median token RMS (engines/passes.py). A NaN or infinite state makes the
    largest or smallest value of its layer non-finite, so finite ones prove finite states without reading them."""
    expected = (len(info.layer_ids), 3)
    if not isinstance(summary, torch.Tensor) or tuple(summary.shape) != expected or not summary.is_floating_point():
        shape = tuple(summary.shape) if isinstance(summary, torch.Tensor) else None
        raise ShardFormatError(
            f"sample {sample_id}: hidden states handed to the shard writer without the engine's statistics "
            f"(a {expected} float summary; got {shape})"
        )
    if not torch.isfinite(summary[:, :2]).all():
        raise NonFiniteRowRefused(sample_id)


@dataclass(frozen=True)
class TrainingSample:
    id: str
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    hidden_states: torch.Tensor
    finish_reason: str
    thinking: bool
    # Checks the quality gate flagged (empty when the sample passed every check).
    flags: tuple[str, ...] = ()


class TrainingShard:
    """One local shard file, sample by sample: a view over `ShardIndex`, so that it accepts exactly the shards the
    strict reader accepts. Tensors come as stored (int32 ids, uint8 mask, states in the stored dtype; fp8 states
    dequantised to bfloat16); per-sample lists are plain lists."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._source = LocalFileSource(self.path)
        self.index = ShardIndex.load(self._source)
        self.metadata: dict[str, str] = self.index.metadata
        self.offsets = self.index.offsets
        self.sample_ids = list(self.index.sample_ids)
        self.finish_reasons = list(self.index.finish_reasons)
        self.thinking = list(self.index.thinking)
        self.layer_ids = list(self.index.layer_ids)
        self.quality: list[dict[str, Any]] = list(self.index.verdicts)
        self.dropped: list[dict[str, Any]] = list(self.index.dropped)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def num_tokens(self) -> int:
        return self.index.num_tokens

    def __getitem__(self, index: int) -> TrainingSample:
        if not 0 <= index < len(self):
            raise IndexError(index)
        stored = self.index.layout.tensors["hidden_states"].torch_dtype
        hidden_dtype = torch.bfloat16 if self.index.dtype == FP8_NAME else stored
        tensors = read_sample(self.index, self._source, index, hidden_dtype, token_dtype=None)
        return TrainingSample(
            id=self.sample_ids[index],
            input_ids=tensors["input_ids"],
            loss_mask=tensors["loss_mask"],
            hidden_states=tensors["hidden_states"],
            finish_reason=self.finish_reasons[index],
            thinking=self.thinking[index],
            flags=self.index.quality_flags[index],
        )

    def loss_mask_sums(self) -> list[int]:
        """Generated tokens per sample, read from the mask alone (no hidden states loaded)."""
        mask = read_rows(self.index.layout.tensors["loss_mask"], self._source, 0, self.num_tokens).to(torch.int64)
        running = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(mask, 0)])
        return (running[self.offsets[1:]] - running[self.offsets[:-1]]).tolist()

    def info(self) -> dict[str, Any]:
        """The shard-level metadata (per-sample lists left out)."""
        return {key: value for key, value in self.metadata.items() if key not in PER_SAMPLE_KEYS}
