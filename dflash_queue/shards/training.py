"""Training shards: one safetensors file of many samples, concatenated along the token axis (written by
`training_writer`, sample by sample).

Tensors:
  input_ids      int32  [T]         prompt ids followed by completion ids, per sample
  loss_mask      uint8  [T]         1 exactly on generated tokens (every regenerated turn)
  hidden_states  dtype  [T, K, H]   output of decoder layer `layer_ids[k]` at each token
  offsets        int64  [N + 1]     sample i spans tokens offsets[i]:offsets[i + 1]
  hidden_scales  fp32   [T, K]      only when dtype is fp8_e4m3: states = fp8 * scale (see fp8.py)

Metadata (all strings, JSON where structured) says what the tensors mean: target model, layer ids and their
convention, what each captured entry is (`layer_states`: "decoder_output", the residual stream after decoder
layer i before any norm; "last_layer", the same for the last decoder layer, stored as the verifier's last state;
or "final_norm", the last layer after the model's final norm, which is Transformers' last `hidden_states`
entry), how the states were computed (`extraction`: "packed" or "padded") and the canary's
check of them (`canary`: samples recomputed alone and their relative error per layer), dtype, sample ids (a
sample stored as one sequence per regenerated turn has one row per turn, and `sample_turns` says which),
finish reasons, versions, and the quality gate's word per sample (`quality`:
flags, answer tokens, thinking state, so that training can filter flagged samples) and on the samples it
dropped (`dropped`: id and failed checks; they are not in the tensors). A shard whose samples were all dropped
holds no tokens.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.fp8 import FP8_NAME, SCALES_TENSOR, dequantize_fp8
from dflash_queue.shards.verdicts import Verdict

FORMAT = "dflash-queue/hidden-states"
FORMAT_VERSION = "1"
# "Layer i" is the output of decoder layer i (before the final norm): Transformers' hidden_states[i + 1].
LAYER_CONVENTION = "decoder_layer_output"
HF_HIDDEN_STATES_INDEX = "layer_id + 1"
# What a captured entry is: the residual stream after its decoder layer (a layer the drafter conditions on); the
# last decoder layer's output before the final norm, stored as the verifier's last state (vLLM's aux layer N: what
# speculators' trainers normalise themselves); or the last layer after the final norm (Transformers' last
# hidden_states entry: what SpecForge's EAGLE-3 trainer takes as the target's hidden state).
DECODER_OUTPUT = "decoder_output"
LAST_LAYER = "last_layer"
FINAL_NORM = "final_norm"
LAYER_STATES = (DECODER_OUTPUT, LAST_LAYER, FINAL_NORM)

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
    if sample.loss_mask.shape[0] != tokens:
        raise ShardFormatError(f"sample {sample.id}: loss_mask has {sample.loss_mask.shape[0]} tokens, not {tokens}")
    check_states(sample.id, tokens, sample.hidden_states, info)


def check_states(sample_id: str, tokens: int, hidden_states: torch.Tensor, info: ShardInfo) -> None:
    """One sequence's states have the shard's shape [tokens, K, H] and are finite."""
    expected = (tokens, len(info.layer_ids), info.hidden_size)
    if tuple(hidden_states.shape) != expected:
        raise ShardFormatError(
            f"sample {sample_id}: hidden_states shape {tuple(hidden_states.shape)}, expected {expected}"
        )
    if not torch.isfinite(hidden_states).all():
        raise NonFiniteHiddenStates(sample_id)


class NonFiniteHiddenStates(ShardFormatError):
    def __init__(self, sample_id: str) -> None:
        super().__init__(f"sample {sample_id}: hidden states contain NaN or Inf")
        self.sample_id = sample_id


def quality_entry(verdict: Verdict | None) -> dict[str, Any]:
    verdict = verdict or Verdict()
    return {"flags": list(verdict.flags), "answer_tokens": verdict.answer_tokens, "thinking": verdict.thinking}


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
