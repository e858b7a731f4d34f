"""Random access to training shards on any storage: an index from the header and offsets, then one sample's
byte ranges per read.

`ShardIndex.load` reads a shard's header (one or two small reads) and its `offsets` tensor, checks that the
file is a training shard whose tensors agree with each other and with the metadata, and keeps what a reader
needs: where each tensor lies, where each sample starts, and the per-sample metadata. `read_sample` then reads
exactly the rows of one sample from each tensor.

This is the one place that parses and checks the format (training_format.py): the training `ShardDataset`,
`inspect`, `verify`, the extract lane's skip of a stored shard and `TrainingShard` (training.py, a view for
tests, the audit and tools) all read through it, so a shard refused here is refused everywhere.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import torch

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.fp8 import FP8_NAME, SCALES_TENSOR, dequantize_fp8
from dflash_queue.shards.layout import SafetensorsLayout, TensorSpec
from dflash_queue.shards.ranges import ByteSource, read_layout
from dflash_queue.shards.training_format import DECODER_OUTPUT, FORMAT, LAYER_STATES
from dflash_queue.shards.verdicts import quality_entry

# The stored tensor dtype each `dtype` metadata value implies.
STORED_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", FP8_NAME: "F8_E4M3"}
# The quality gate's per-sample verdicts: a JSON list of objects, each with a `flags` list of strings.
QUALITY_VERDICTS_KEY = "quality"
PER_SAMPLE_KEYS = (
    "sample_ids", "finish_reasons", "thinking", QUALITY_VERDICTS_KEY, "dropped", "dead_lettered", "sample_turns"
)


@dataclass(frozen=True)
class SampleMeta:
    """What is known about a sample without reading its tensors."""

    id: str
    shard: str
    index: int  # position in its shard
    num_tokens: int
    finish_reason: str
    thinking: bool
    quality_flags: tuple[str, ...]


@dataclass(frozen=True)
class ShardIndex:
    where: str
    layout: SafetensorsLayout
    offsets: torch.Tensor  # int64 [N + 1]
    sample_ids: tuple[str, ...]
    finish_reasons: tuple[str, ...]
    thinking: tuple[bool, ...]
    quality_flags: tuple[tuple[str, ...], ...]
    layer_ids: tuple[int, ...]
    hidden_size: int
    dtype: str
    # Per layer id: "decoder_output" (before any norm), "last_layer" or "final_norm" (after the model's final norm).
    layer_states: tuple[str, ...] = ()
    # The quality gate's verdict per sample as stored (flags, answer tokens, thinking state); a shard written
    # before the gate existed gets an empty verdict per sample.
    verdicts: tuple[dict[str, Any], ...] = ()
    # Samples the quality gate dropped (id and failed checks): accounted for here, not in the tensors.
    dropped: tuple[dict[str, Any], ...] = ()

    @property
    def metadata(self) -> dict[str, str]:
        return self.layout.metadata

    @property
    def num_samples(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def __len__(self) -> int:
        return self.num_samples

    def rows(self, index: int) -> tuple[int, int]:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"{self.where}: sample {index} of {self.num_samples}")
        return int(self.offsets[index]), int(self.offsets[index + 1])

    def sample_meta(self, index: int) -> SampleMeta:
        start, end = self.rows(index)
        return SampleMeta(
            id=self.sample_ids[index],
            shard=self.where,
            index=index,
            num_tokens=end - start,
            finish_reason=self.finish_reasons[index],
            thinking=self.thinking[index],
            quality_flags=self.quality_flags[index],
        )

    def shard_info(self) -> dict[str, Any]:
        """The shard-level metadata (per-sample lists left out)."""
        return {k: v for k, v in self.metadata.items() if k not in PER_SAMPLE_KEYS}

    @classmethod
    def load(cls, source: ByteSource) -> ShardIndex:
        layout = read_layout(source)
        where = source.where
        meta = layout.metadata
        if meta.get("format") != FORMAT:
            raise ShardFormatError(f"{where}: metadata format is {meta.get('format')!r}, not {FORMAT!r}")
        dtype = _required(meta, "dtype", where)
        if dtype not in STORED_DTYPES:
            raise ShardFormatError(f"{where}: metadata dtype {dtype!r} is not one of {sorted(STORED_DTYPES)}")
        layer_ids = _json_list(meta, "layer_ids", where, int)
        hidden_size = _int(meta, "hidden_size", where)
        tensors = _check_tensors(layout, where, dtype=dtype, num_layers=len(layer_ids), hidden_size=hidden_size)
        layer_states = _layer_states(meta, where, len(layer_ids))

        offsets_spec = tensors["offsets"]
        raw = source.read(*offsets_spec.row_range(0, offsets_spec.shape[0]))
        offsets = offsets_spec.decode_rows(raw, offsets_spec.shape[0]).clone()
        total = tensors["input_ids"].shape[0]
        if offsets.shape[0] == 0 or int(offsets[0]) != 0 or int(offsets[-1]) != total:
            raise ShardFormatError(f"{where}: offsets must run from 0 to {total} tokens")
        if bool((offsets[1:] < offsets[:-1]).any()):
            raise ShardFormatError(f"{where}: offsets decrease")

        count = offsets.shape[0] - 1
        sample_ids = _json_list(meta, "sample_ids", where, str, count=count)
        finish_reasons = _json_list(meta, "finish_reasons", where, str, count=count)
        thinking = _json_list(meta, "thinking", where, bool, count=count)
        verdicts = _verdicts(meta, where, count)
        return cls(
            where=where,
            layout=layout,
            offsets=offsets,
            sample_ids=tuple(sample_ids),
            finish_reasons=tuple(finish_reasons),
            thinking=tuple(thinking),
            quality_flags=tuple(tuple(v.get("flags", ())) for v in verdicts),
            layer_ids=tuple(layer_ids),
            hidden_size=hidden_size,
            dtype=dtype,
            layer_states=layer_states,
            verdicts=verdicts,
            dropped=_dropped(meta, where),
        )


def read_sample(
    index: ShardIndex,
    source: ByteSource,
    sample: int,
    hidden_dtype: torch.dtype = torch.bfloat16,
    *,
    dequantize: bool = True,
    token_dtype: torch.dtype | None = torch.int64,
) -> dict[str, torch.Tensor]:
    """`input_ids` and `loss_mask` (int64 [T], or as stored when `token_dtype` is None) and `hidden_states`
    ([T, K, H] in `hidden_dtype`) of one sample, reading only its rows. An fp8 shard's states are dequantised,
    unless `dequantize` is False: then they come as stored (float8_e4m3fn) with `hidden_scales` (float32
    [T, K]), to be dequantised on the GPU."""
    start, end = index.rows(sample)
    tensors = index.layout.tensors
    hidden = read_rows(tensors["hidden_states"], source, start, end)
    out = {name: read_rows(tensors[name], source, start, end) for name in ("input_ids", "loss_mask")}
    if token_dtype is not None:
        out = {name: values.to(token_dtype) for name, values in out.items()}
    if index.dtype == FP8_NAME:
        scales = read_rows(tensors[SCALES_TENSOR], source, start, end)
        if dequantize:
            hidden = dequantize_fp8(hidden, scales, hidden_dtype)
        else:
            out[SCALES_TENSOR] = scales
    elif hidden.dtype != hidden_dtype:
        hidden = hidden.to(hidden_dtype)
    out["hidden_states"] = hidden
    return out


def read_rows(spec: TensorSpec, source: ByteSource, start: int, end: int) -> torch.Tensor:
    return spec.decode_rows(source.read(*spec.row_range(start, end)), end - start)


def _check_tensors(
    layout: SafetensorsLayout, where: str, *, dtype: str, num_layers: int, hidden_size: int
) -> dict[str, TensorSpec]:
    tensors = layout.tensors
    required = ["input_ids", "loss_mask", "hidden_states", "offsets"] + ([SCALES_TENSOR] if dtype == FP8_NAME else [])
    missing = [name for name in required if name not in tensors]
    if missing:
        raise ShardFormatError(f"{where}: missing tensors {missing}")
    total = tensors["input_ids"].shape[0] if len(tensors["input_ids"].shape) == 1 else -1
    expected = {
        "input_ids": ({"I32", "I64"}, (total,)),
        "loss_mask": ({"U8", "BOOL", "I64"}, (total,)),
        "hidden_states": ({STORED_DTYPES[dtype]}, (total, num_layers, hidden_size)),
        SCALES_TENSOR: ({"F32"}, (total, num_layers)),
    }
    if total < 0:
        raise ShardFormatError(f"{where}: input_ids has shape {list(tensors['input_ids'].shape)}, not [tokens]")
    for name, (dtypes, shape) in expected.items():
        spec = tensors.get(name)
        if spec is None:
            continue
        if spec.dtype not in dtypes:
            raise ShardFormatError(f"{where}: tensor {name!r} is {spec.dtype}, expected {' or '.join(sorted(dtypes))}")
        if spec.shape != shape:
            raise ShardFormatError(f"{where}: tensor {name!r} has shape {list(spec.shape)}, expected {list(shape)}")
    offsets = tensors["offsets"]
    if offsets.dtype != "I64" or len(offsets.shape) != 1:
        raise ShardFormatError(f"{where}: tensor 'offsets' must be I64 [samples + 1]")
    return tensors


def _required(meta: dict[str, str], key: str, where: str) -> str:
    if key not in meta:
        raise ShardFormatError(f"{where}: metadata key {key!r} is missing")
    return meta[key]


def _int(meta: dict[str, str], key: str, where: str) -> int:
    value = _required(meta, key, where)
    try:
        return int(value)
    except ValueError:
        raise ShardFormatError(f"{where}: metadata {key!r} is {value!r}, not an integer") from None


def _json(meta: dict[str, str], key: str, where: str) -> Any:
    try:
        return json.loads(_required(meta, key, where))
    except json.JSONDecodeError as exc:
        raise ShardFormatError(f"{where}: metadata {key!r} is not valid JSON: {exc}") from None


def _json_list(meta: dict[str, str], key: str, where: str, kind: type, *, count: int | None = None) -> list:
    value = _json(meta, key, where)
    def fits(v: Any) -> bool:
        return isinstance(v, kind) and not (kind is int and isinstance(v, bool))

    if not isinstance(value, list) or not all(fits(v) for v in value):
        raise ShardFormatError(f"{where}: metadata {key!r} must be a JSON list of {kind.__name__}")
    if count is not None and len(value) != count:
        raise ShardFormatError(f"{where}: metadata {key!r} has {len(value)} entries for {count} samples")
    return value


def _verdicts(meta: dict[str, str], where: str, count: int) -> tuple[dict[str, Any], ...]:
    if QUALITY_VERDICTS_KEY not in meta:
        return tuple(quality_entry(None) for _ in range(count))
    verdicts = _json(meta, QUALITY_VERDICTS_KEY, where)
    if not isinstance(verdicts, list) or not all(isinstance(v, dict) and _strings(v.get("flags", [])) for v in verdicts):
        raise ShardFormatError(
            f"{where}: metadata {QUALITY_VERDICTS_KEY!r} must be a JSON list of objects with a 'flags' list"
        )
    if len(verdicts) != count:
        raise ShardFormatError(f"{where}: per-sample quality flags have {len(verdicts)} entries for {count} samples")
    return tuple(verdicts)


def _dropped(meta: dict[str, str], where: str) -> tuple[dict[str, Any], ...]:
    """Shards written before the quality gate existed dropped nothing."""
    if "dropped" not in meta:
        return ()
    dropped = _json(meta, "dropped", where)
    if not isinstance(dropped, list) or not all(
        isinstance(d, dict) and isinstance(d.get("id"), str) and _strings(d.get("flags", [])) for d in dropped
    ):
        raise ShardFormatError(f"{where}: metadata 'dropped' must be a JSON list of objects with an 'id' and 'flags'")
    return tuple(dropped)


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _layer_states(meta: dict[str, str], where: str, count: int) -> tuple[str, ...]:
    """Shards written before `layer_states` existed hold decoder-layer outputs only."""
    if "layer_states" not in meta:
        return (DECODER_OUTPUT,) * count
    states = _json_list(meta, "layer_states", where, str)
    if len(states) != count or any(state not in LAYER_STATES for state in states):
        raise ShardFormatError(
            f"{where}: metadata layer_states {states!r} must give one of {list(LAYER_STATES)} per layer id ({count})"
        )
    return tuple(states)
