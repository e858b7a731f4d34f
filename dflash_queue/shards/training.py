"""Training shards: one safetensors file of many samples, concatenated along the token axis.

Tensors:
  input_ids      int32  [T]         prompt ids followed by completion ids, per sample
  loss_mask      uint8  [T]         1 exactly on generated tokens (every regenerated turn)
  hidden_states  dtype  [T, K, H]   output of decoder layer `layer_ids[k]` at each token
  offsets        int64  [N + 1]     sample i spans tokens offsets[i]:offsets[i + 1]
  hidden_scales  fp32   [T, K]      only when dtype is fp8_e4m3: states = fp8 * scale (see fp8.py)

Metadata (all strings, JSON where structured) says what the tensors mean: target model, layer ids and their
convention, what each captured entry is (`layer_states`: "decoder_output", the residual stream after decoder
layer i before any norm, or "final_norm", the last layer after the model's final norm, which is Transformers'
last `hidden_states` entry), how the states were computed (`extraction`: "packed" or "padded") and the canary's
check of them (`canary`: samples recomputed alone and their relative error per layer), dtype, sample ids (a
sample stored as one sequence per regenerated turn has one row per turn, and `sample_turns` says which),
finish reasons, versions, and the quality gate's word per sample (`quality`:
flags, answer tokens, thinking state, so that training can filter flagged samples) and on the samples it
dropped (`dropped`: id and failed checks; they are not in the tensors). A shard whose samples were all dropped
holds no tokens.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_queue.errors import ShardFormatError
from dflash_queue.quality.gate import Verdict
from dflash_queue.shards.fp8 import FP8_NAME, SCALES_TENSOR, dequantize_fp8, quantize_fp8

FORMAT = "dflash-queue/hidden-states"
FORMAT_VERSION = "1"
# "Layer i" is the output of decoder layer i (before the final norm): Transformers' hidden_states[i + 1].
LAYER_CONVENTION = "decoder_layer_output"
HF_HIDDEN_STATES_INDEX = "layer_id + 1"
# What a captured entry is: the residual stream after its decoder layer, or the last layer after the final norm.
DECODER_OUTPUT = "decoder_output"
FINAL_NORM = "final_norm"
LAYER_STATES = (DECODER_OUTPUT, FINAL_NORM)

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
        }


def validate_sample(sample: ExtractedSample, info: ShardInfo) -> None:
    """Lengths agree, shapes match the model, values are finite: checked before anything is written."""
    tokens = sample.input_ids.shape[0]
    expected = (tokens, len(info.layer_ids), info.hidden_size)
    if tuple(sample.hidden_states.shape) != expected:
        raise ShardFormatError(
            f"sample {sample.id}: hidden_states shape {tuple(sample.hidden_states.shape)}, expected {expected}"
        )
    if sample.loss_mask.shape[0] != tokens:
        raise ShardFormatError(f"sample {sample.id}: loss_mask has {sample.loss_mask.shape[0]} tokens, not {tokens}")
    if not torch.isfinite(sample.hidden_states).all():
        raise NonFiniteHiddenStates(sample.id)


class NonFiniteHiddenStates(ShardFormatError):
    def __init__(self, sample_id: str) -> None:
        super().__init__(f"sample {sample_id}: hidden states contain NaN or Inf")
        self.sample_id = sample_id


def quality_entry(verdict: Verdict | None) -> dict[str, Any]:
    verdict = verdict or Verdict()
    return {"flags": list(verdict.flags), "answer_tokens": verdict.answer_tokens, "thinking": verdict.thinking}


def write_training_shard(
    path: Path,
    samples: Sequence[ExtractedSample],
    info: ShardInfo,
    *,
    dropped: Sequence[tuple[str, Verdict]] = (),
    dead: Sequence[str] = (),
    canary: dict[str, Any] | None = None,
) -> None:
    """Write one shard. `dropped`: (id, verdict) of samples the quality gate left out; `dead`: ids of samples
    left out because they alone made the engine fail (each has a dead letter); `canary`: the run-time check of
    the states (see lanes/extract.py). A shard may be empty only when every one of its samples was dropped or is
    dead."""
    if not samples and not dropped and not dead:
        raise ShardFormatError("refusing to write an empty shard")
    for sample in samples:
        validate_sample(sample, info)
    lengths = [s.input_ids.shape[0] for s in samples]
    offsets = torch.zeros(len(samples) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int64), 0)
    width = (len(info.layer_ids), info.hidden_size)
    tensors = {
        "input_ids": torch.cat([s.input_ids.to(torch.int32) for s in samples])
        if samples else torch.zeros(0, dtype=torch.int32),
        "loss_mask": torch.cat([s.loss_mask.to(torch.uint8) for s in samples])
        if samples else torch.zeros(0, dtype=torch.uint8),
        "offsets": offsets,
    }
    # A shard whose samples were all dropped by the quality gate still has well-formed, empty tensors.
    hidden = [s.hidden_states for s in samples] or [torch.zeros((0, *width))]
    if info.dtype == FP8_NAME:
        # Quantised sample by sample: a float32 copy of one sample, never of the whole shard.
        quantized = [quantize_fp8(h) for h in hidden]
        tensors["hidden_states"] = torch.cat([q for q, _ in quantized]).contiguous()
        tensors[SCALES_TENSOR] = torch.cat([scales for _, scales in quantized]).contiguous()
    else:
        dtype = _DTYPES[info.dtype]
        tensors["hidden_states"] = torch.cat([h.to(dtype) for h in hidden]).contiguous()
    metadata = info.to_metadata()
    metadata["sample_ids"] = json.dumps([s.id for s in samples])
    metadata["finish_reasons"] = json.dumps([s.finish_reason for s in samples])
    metadata["thinking"] = json.dumps([s.thinking for s in samples])
    metadata["quality"] = json.dumps([quality_entry(s.quality) for s in samples])
    metadata["dropped"] = json.dumps([{"id": i, "flags": list(v.flags)} for i, v in dropped])
    metadata["dead_lettered"] = json.dumps(list(dead))
    if any(s.turn is not None for s in samples):
        # Rows of one sample, one per regenerated turn (the sample id repeats): the turn each row ends with.
        metadata["sample_turns"] = json.dumps([s.turn for s in samples])
    if canary is not None:
        metadata["canary"] = json.dumps(canary)
    save_file(tensors, str(path), metadata=metadata)


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
    """Random access to the samples of one shard without reading the whole file."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            with safe_open(str(self.path), framework="pt") as handle:
                self.metadata: dict[str, str] = handle.metadata() or {}
                self.offsets = handle.get_tensor("offsets")
        except Exception as exc:  # safetensors raises its own error types for corrupt files
            raise ShardFormatError(f"{self.path}: not a readable safetensors shard: {exc}") from None
        if self.metadata.get("format") != FORMAT:
            raise ShardFormatError(f"{self.path}: metadata format is {self.metadata.get('format')!r}, not {FORMAT}")
        self.sample_ids: list[str] = json.loads(self.metadata["sample_ids"])
        self.finish_reasons: list[str] = json.loads(self.metadata["finish_reasons"])
        self.thinking: list[bool] = json.loads(self.metadata["thinking"])
        self.layer_ids: list[int] = json.loads(self.metadata["layer_ids"])
        # Shards written before the quality gate existed have no verdicts: every sample passed nothing.
        self.quality: list[dict[str, Any]] = json.loads(self.metadata.get("quality", "null")) or [
            quality_entry(None) for _ in self.sample_ids
        ]
        self.dropped: list[dict[str, Any]] = json.loads(self.metadata.get("dropped", "[]"))
        if len(self.sample_ids) + 1 != self.offsets.shape[0]:
            raise ShardFormatError(f"{self.path}: {len(self.sample_ids)} sample ids but {self.offsets.shape[0]} offsets")

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def __getitem__(self, index: int) -> TrainingSample:
        if not 0 <= index < len(self):
            raise IndexError(index)
        start, end = int(self.offsets[index]), int(self.offsets[index + 1])
        with safe_open(str(self.path), framework="pt") as handle:
            hidden = handle.get_slice("hidden_states")[start:end]
            if self.metadata.get("dtype") == FP8_NAME:
                hidden = dequantize_fp8(hidden, handle.get_slice(SCALES_TENSOR)[start:end], torch.bfloat16)
            return TrainingSample(
                id=self.sample_ids[index],
                input_ids=handle.get_slice("input_ids")[start:end],
                loss_mask=handle.get_slice("loss_mask")[start:end],
                hidden_states=hidden,
                finish_reason=self.finish_reasons[index],
                thinking=self.thinking[index],
                flags=tuple(self.quality[index]["flags"]),
            )

    def loss_mask_sums(self) -> list[int]:
        """Generated tokens per sample, read from the mask alone (no hidden states loaded)."""
        with safe_open(str(self.path), framework="pt") as handle:
            mask = handle.get_tensor("loss_mask").to(torch.int64)
        running = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(mask, 0)])
        return (running[self.offsets[1:]] - running[self.offsets[:-1]]).tolist()

    def info(self) -> dict[str, Any]:
        per_sample = {"sample_ids", "finish_reasons", "thinking", "quality", "dropped", "sample_turns"}
        return {key: value for key, value in self.metadata.items() if key not in per_sample}
