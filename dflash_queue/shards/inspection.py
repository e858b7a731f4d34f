"""What one training shard holds, and whether it is whole: `dflash-queue inspect`.

Checks, each reported as ok, failed (with where and what) or not run:

* structure: the safetensors header parses, tensors are packed end to end and fill the file exactly, the
  training-shard tensors agree with each other and with the metadata (tokens, K, H, dtype, offsets, per-sample
  lists);
* layers: the layer convention is known and the ids fit the model;
* loss_mask: only 0 and 1;
* values (`deep`): every hidden state (and fp8 scale) finite;
* checksum: the sha256 of the whole object, compared with what the storage recorded, when it records one
  (a storage exposes `recorded_sha256(key)`, or a `<key>.sha256` sidecar holds it in `sha256sum` format);
* audit: whether the reference audit marked the shard suspect (its mark in the run's storage: no reader serves it
  as good until it is extracted again). A suspect shard may be whole: this says so without failing the report.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.fp8 import FP8_NAME, SCALES_TENSOR
from dflash_queue.shards.layer_conventions import checked_layer_ids
from dflash_queue.shards.ranges import ByteSource, open_source
from dflash_queue.shards.reader import ShardIndex, read_rows
from dflash_queue.shards.suspect_lookup import shard_place, suspect_marks
from dflash_queue.shards.suspects import SuspectMark
from dflash_queue.storage.base import Storage

OK, FAILED, SKIPPED, UNRECORDED, SUSPECT = "ok", "FAILED", "not run", "no record", "SUSPECT"
CHECKSUM_CHUNK = 16 * 1024 * 1024
SIDECAR_SUFFIX = ".sha256"


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str = ""


@dataclass
class ShardReport:
    where: str
    size: int
    checks: list[Check] = field(default_factory=list)
    index: ShardIndex | None = None
    completion_tokens: int = 0
    sha256: str | None = None
    # The reference audit's mark on the shard (None: it carries none).
    suspect: SuspectMark | None = None

    @property
    def ok(self) -> bool:
        return all(check.status != FAILED for check in self.checks)

    @property
    def finish_reasons(self) -> Counter[str]:
        return Counter(self.index.finish_reasons) if self.index else Counter()

    @property
    def quality_flags(self) -> Counter[str]:
        return Counter(f for flags in self.index.quality_flags for f in flags) if self.index else Counter()

    def lengths(self) -> list[int]:
        if self.index is None:
            return []
        offsets = self.index.offsets
        return (offsets[1:] - offsets[:-1]).tolist()

    def summary(self) -> dict[str, Any]:
        """The facts a person asks first, as plain values."""
        index = self.index
        out: dict[str, Any] = {"shard": self.where, "size_bytes": self.size}
        if index is None:
            return out
        lengths = self.lengths()
        out.update(
            target_model=index.metadata.get("target_model", ""),
            samples=index.num_samples,
            tokens=index.num_tokens,
            completion_tokens=self.completion_tokens,
            tokens_per_sample=(min(lengths), round(sum(lengths) / len(lengths), 1), max(lengths)) if lengths else (),
            layer_ids=list(index.layer_ids),
            layer_convention=index.metadata.get("layer_convention", ""),
            num_model_layers=index.metadata.get("num_model_layers", ""),
            hidden_size=index.hidden_size,
            dtype=index.dtype,
            bytes_per_token=round(self.size / index.num_tokens, 1) if index.num_tokens else None,
        )
        return out


def inspect_shard(storage: Storage, key: str, *, checksum: bool = True, deep: bool = False) -> ShardReport:
    source = open_source(storage, key)
    report = ShardReport(where=source.where, size=source.size())
    try:
        index = ShardIndex.load(source)
    except ShardFormatError as exc:
        report.checks.append(Check("structure", FAILED, str(exc)))
    else:
        report.index = index
        report.checks.append(
            Check("structure", OK, f"{len(index.layout.tensors)} tensors packed, offsets and metadata agree")
        )
        report.checks.append(_check_layers(index))
        report.checks.append(_check_loss_mask(index, source, report))
        report.checks.append(_check_values(index, source) if deep else Check("values", SKIPPED, "use --deep"))
    report.checks.append(_check_mark(storage, key, report))
    report.checks.append(_check_checksum(storage, key, source, report) if checksum else Check("checksum", SKIPPED))
    return report


def _check_mark(storage: Storage, key: str, report: ShardReport) -> Check:
    if shard_place(storage, key) is None:
        return Check("audit", SKIPPED, "not in a run's shards/ folder: no suspect mark to look for")
    report.suspect = suspect_marks(storage, [key]).get(key)
    if report.suspect is not None:
        return Check("audit", SUSPECT, f"{report.suspect.describe()} (`dflash-queue suspects reextract` extracts it "
                     "again; no reader serves it as good until then)")
    return Check("audit", OK, "no suspect mark")


def sample_preview(storage: Storage, key: str, index: ShardIndex, sample: int) -> dict[str, Any]:
    """Token ids of one sample with its completion start, without reading its hidden states."""
    source = open_source(storage, key)
    start, end = index.rows(sample)
    ids = read_rows(index.layout["input_ids"], source, start, end).to(torch.int64)
    mask = read_rows(index.layout["loss_mask"], source, start, end).to(torch.int64)
    completion = torch.nonzero(mask).flatten()
    meta = index.sample_meta(sample)
    return {
        "sample": sample,
        "id": meta.id,
        "tokens": meta.num_tokens,
        "finish_reason": meta.finish_reason,
        # Whether the prompt asked for thinking, and what the reply did (the gate's verdict: closed, off, unclosed,
        # none), which `audit` counts.
        "thinking_requested": meta.thinking,
        "thinking": str(index.verdicts[sample].get("thinking", "none")),
        "quality_flags": list(meta.quality_flags),
        "input_ids": ids.tolist(),
        "completion_start": int(completion[0]) if completion.numel() else None,
    }


def recorded_sha256(storage: Storage, key: str) -> str | None:
    """The sha256 a storage recorded for an object, if it records one."""
    recorder = getattr(storage, "recorded_sha256", None)
    if callable(recorder):
        return recorder(key)
    sidecar = key + SIDECAR_SUFFIX
    if storage.exists(sidecar):
        text = storage.read_bytes(sidecar).decode("ascii", errors="replace").split()
        return text[0].lower() if text else ""
    return None


def _check_layers(index: ShardIndex) -> Check:
    try:
        layers, num_layers = checked_layer_ids(index)
    except ShardFormatError as exc:
        return Check("layers", FAILED, str(exc))
    return Check("layers", OK, f"decoder layers {layers} of {num_layers} ({index.metadata.get('layer_convention')})")


def _check_loss_mask(index: ShardIndex, source: ByteSource, report: ShardReport) -> Check:
    mask = read_rows(index.layout["loss_mask"], source, 0, index.num_tokens).to(torch.int64)
    bad = int(((mask != 0) & (mask != 1)).sum())
    report.completion_tokens = int(mask.sum()) if not bad else 0
    if bad:
        return Check("loss_mask", FAILED, f"{index.where}: {bad} loss_mask values other than 0 and 1")
    return Check("loss_mask", OK, f"{report.completion_tokens} of {index.num_tokens} tokens are completion tokens")


def _check_values(index: ShardIndex, source: ByteSource) -> Check:
    scales_spec = index.layout.tensors.get(SCALES_TENSOR)
    for sample in range(index.num_samples):
        start, end = index.rows(sample)
        hidden = read_rows(index.layout["hidden_states"], source, start, end)
        if not bool(torch.isfinite(hidden.to(torch.float32)).all()):
            return Check("values", FAILED, f"{index.where}: sample {sample} ({index.sample_ids[sample]}) has NaN or Inf")
        if index.dtype == FP8_NAME and scales_spec is not None:
            scales = read_rows(scales_spec, source, start, end)
            if not bool((torch.isfinite(scales) & (scales > 0)).all()):
                return Check("values", FAILED, f"{index.where}: sample {sample} has scales that are not finite and > 0")
    return Check("values", OK, f"all {index.num_tokens} tokens finite")


def _check_checksum(storage: Storage, key: str, source: ByteSource, report: ShardReport) -> Check:
    digest = hashlib.sha256()
    for start in range(0, report.size, CHECKSUM_CHUNK):
        digest.update(source.read(start, min(CHECKSUM_CHUNK, report.size - start)).numpy().data)
    report.sha256 = digest.hexdigest()
    recorded = recorded_sha256(storage, key)
    if recorded is None:
        why = ("the storage recorded none for it" if callable(getattr(storage, "recorded_sha256", None)) else
               f"local storage keeps no checksum; a {key}{SIDECAR_SUFFIX} file beside it would be compared")
        return Check("checksum", UNRECORDED, f"sha256 {report.sha256} ({why})")
    if recorded != report.sha256:
        return Check("checksum", FAILED, f"{report.where}: sha256 {report.sha256} but the storage recorded {recorded}")
    return Check("checksum", OK, f"sha256 {report.sha256} matches the recorded one")
