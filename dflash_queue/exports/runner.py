"""`dflash-queue export`: every kept sample of a set of shards, one file per sample, in a peer's layout.

Next to the files: `export.json` (format, source, model, layer ids in the target's convention and in this
project's, dtype, counts) and `index.jsonl` (one line per file: file, sample id, shard, tokens, finish reason,
quality flags). Files are numbered in the dataset's order (shards sorted by key, samples in shard order), so
the same shards and filters always give the same numbering.
"""

from __future__ import annotations

import json
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_queue.exports.formats import ExportFormat
from dflash_queue.shards.layer_conventions import DECODER_LAYER_OUTPUT, checked_layer_ids, convert_layer_ids
from dflash_queue.shards.training import FINAL_NORM
from dflash_queue.storage.base import Storage
from dflash_queue.training.dataset import ShardDataset

MANIFEST = "export.json"
INDEX = "index.jsonl"


@dataclass
class ExportReport:
    format: str
    out: str
    samples: int = 0
    tokens: int = 0
    bytes_written: int = 0
    target_layer_ids: list[int] = field(default_factory=list)
    layer_ids_key: str = ""
    bad_shards: list[tuple[str, str]] = field(default_factory=list)
    dropped: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        out = [
            f"exported:    {self.samples} samples, {self.tokens} tokens, {self.bytes_written / 1e6:.1f} MB "
            f"as {self.format} in {self.out}",
            f"layers:      {self.layer_ids_key} = {self.target_layer_ids}",
        ]
        if self.dropped:
            out.append("filtered:    " + ", ".join(f"{n} ({reason})" for reason, n in sorted(self.dropped.items())))
        for key, problem in self.bad_shards:
            out.append(f"bad shard:   {key}: {problem}")
        out.extend(f"note:        {note}" for note in self.notes)
        return out


def export_dataset(
    dataset: ShardDataset,
    export_format: ExportFormat,
    out: Storage,
    *,
    source: str,
    on_sample: Callable[[int], None] | None = None,
) -> ExportReport:
    """Write every sample of `dataset` into `out`; layer conventions are checked on every shard first."""
    report = ExportReport(
        export_format.name,
        out.url,
        layer_ids_key=export_format.layer_ids_key,
        bad_shards=list(dataset.bad_shards),
        dropped=Counter(dataset.dropped),
    )
    layers: list[int] | None = None
    num_layers, layer_states = 0, tuple[str, ...]()
    for index in dataset.shards:
        layers, num_layers = checked_layer_ids(index)  # the dataset already made every shard agree
        layer_states = index.layer_states
    if layers is None:
        raise ValueError("no readable shard to export")
    report.target_layer_ids = convert_layer_ids(layers, DECODER_LAYER_OUTPUT, export_format.layer_convention)
    if export_format.name == "speculators" and layer_states[-1] != FINAL_NORM:
        report.notes.append(
            f"speculators reads the last of the K layers as the target's final hidden state (after the final "
            f"norm); the last entry of these shards is decoder layer {layers[-1]} of {num_layers} before any norm "
            "(extract with extract.final_norm_state = true for EAGLE-3 training)"
        )

    with tempfile.NamedTemporaryFile("w+", prefix="dfq-export-index-", suffix=".jsonl") as index_file:
        for number in range(len(dataset)):
            item = dataset[number]
            name = export_format.file_name(number)
            data = export_format.encode(item, report.target_layer_ids)
            out.write_bytes(name, data)
            tokens = int(item["input_ids"].shape[0])
            report.samples += 1
            report.tokens += tokens
            report.bytes_written += len(data)
            entry = {
                "file": name,
                "sample_id": item["sample_id"],
                "shard": item["shard"],
                "num_tokens": tokens,
                "finish_reason": item["finish_reason"],
                "quality_flags": item["quality_flags"],
            }
            index_file.write(json.dumps(entry) + "\n")
            if on_sample is not None:
                on_sample(1)
        index_file.flush()
        out.write_file(INDEX, Path(index_file.name))
    manifest = {
        "format": export_format.name,
        "source": source,
        "target_model": dataset.target_model,
        "num_model_layers": num_layers,
        "hidden_size": dataset.hidden_size,
        "layer_ids": report.target_layer_ids,
        "layer_convention": export_format.layer_convention,
        export_format.layer_ids_key: report.target_layer_ids,
        "source_layer_ids": layers,
        "source_layer_convention": DECODER_LAYER_OUTPUT,
        # Per entry: "decoder_output" (before any norm) or "final_norm" (the last layer after the final norm,
        # Transformers' hidden_states[num_model_layers]).
        "layer_states": list(layer_states),
        "hidden_dtype": str(dataset.hidden_dtype).removeprefix("torch."),
        "num_samples": report.samples,
        "num_tokens": report.tokens,
        "filtered": dict(report.dropped),
        "bad_shards": [{"shard": key, "problem": problem} for key, problem in report.bad_shards],
    }
    out.write_bytes(MANIFEST, json.dumps(manifest, indent=2).encode())
    return report


def hidden_dtype_named(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]
