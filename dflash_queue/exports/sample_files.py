"""`dflash-queue export`: every kept sample of a set of shards, one file per sample, in a trainer's layout.

What the trainer needs is checked on every shard first (layer conventions, and the entries its format reads:
formats.py), so that a refused export writes nothing. Next to the files: `export.json` (format, method, source,
model, the layer ids and config fields to give the trainer, the stored entries and what each file holds, dtype,
counts) and `index.jsonl` (one line per file: file, sample id, shard, tokens, finish reason, quality flags).
Files are numbered in the dataset's order (shards sorted by key, samples in shard order), or in a seeded random
order of it for a trainer that holds out its last rows for validation (speculators), so the same shards, filters
and seed always give the same numbering. Samples the trainer cannot take are left out and counted.

A shard the reference audit found suspect is never exported: the dataset leaves it out, and the export is refused
(SuspectShardError, nothing written) unless `skip_suspect`, which exports the rest and records each suspect shard
left out, and why, in `export.json` (`suspect_shards`).
"""

from __future__ import annotations

import json
import random
import tempfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_queue.exports.formats import ExportFormat, Speculators, StoredLayers
from dflash_queue.exports.speculators_table import TOKEN_FREQ, SpeculatorsTable
from dflash_queue.shards.layer_conventions import DECODER_LAYER_OUTPUT, checked_layer_ids
from dflash_queue.shards.suspect_lookup import SuspectShardError
from dflash_queue.storage.base import Storage
from dflash_queue.training.dataset import ShardDataset

MANIFEST = "export.json"
INDEX = "index.jsonl"


@dataclass
class ExportReport:
    format: str
    method: str
    out: str
    samples: int = 0
    tokens: int = 0
    bytes_written: int = 0
    target_layer_ids: list[int] = field(default_factory=list)
    layer_ids_key: str = ""
    trainer: dict = field(default_factory=dict)
    bad_shards: list[tuple[str, str]] = field(default_factory=list)
    # (key, what its mark says) of each suspect shard left out (skip_suspect).
    suspect_shards: list[tuple[str, str]] = field(default_factory=list)
    dropped: Counter[str] = field(default_factory=Counter)  # left out by the dataset's filters
    skipped: Counter[str] = field(default_factory=Counter)  # left out because the trainer cannot take them

    def lines(self) -> list[str]:
        out = [
            f"exported:    {self.samples} samples, {self.tokens} tokens, {self.bytes_written / 1e6:.1f} MB "
            f"as {self.format} ({self.method}) in {self.out}",
            f"layers:      {self.layer_ids_key} = {self.target_layer_ids}",
        ]
        if self.dropped:
            out.append("filtered:    " + ", ".join(f"{n} ({reason})" for reason, n in sorted(self.dropped.items())))
        if self.skipped:
            out.append("left out:    " + ", ".join(f"{n} ({reason})" for reason, n in sorted(self.skipped.items())))
        for key, problem in self.bad_shards:
            out.append(f"bad shard:   {key}: {problem}")
        for key, mark in self.suspect_shards:
            out.append(f"left out, suspect: {key}: {mark}")
        return out


def stored_layers(dataset: ShardDataset) -> StoredLayers:
    """The shards' entries, after checking every shard's layer convention (the dataset made them agree)."""
    found: StoredLayers | None = None
    for index in dataset.shards:
        layers, num_layers = checked_layer_ids(index)
        found = StoredLayers(tuple(layers), tuple(index.layer_states), num_layers)
    if found is None:
        raise ValueError("no readable shard to export")
    return found


def refuse_suspects(dataset: ShardDataset, source: str, skip_suspect: bool) -> list[tuple[str, str]]:
    """The suspect shards `dataset` left out ((key, what its mark says)); SuspectShardError naming each unless
    `skip_suspect`."""
    suspect = list(dataset.suspect_shards)
    if suspect and not skip_suspect:
        shards = "\n".join(f"  {key}: {mark}" for key, mark in suspect)
        raise SuspectShardError(
            f"{source}: {len(suspect)} suspect shard(s), whose states may not be the model's, would be left out of "
            f"the export:\n{shards}\nextract them again first (`dflash-queue suspects reextract -c CONFIG`), or "
            "export without them (--skip-suspect; recorded in export.json); nothing was written"
        )
    return suspect


def export_dataset(
    dataset: ShardDataset,
    export_format: ExportFormat,
    out: Storage,
    *,
    source: str,
    seed: int = 0,
    on_sample: Callable[[int], None] | None = None,
    skip_suspect: bool = False,
) -> ExportReport:
    """Write every sample of `dataset` the trainer can take into `out`. Raises ExportRefused (naming the setting
    to extract with) before writing anything when the shards lack what the trainer reads, and SuspectShardError
    when the dataset left suspect shards out, unless `skip_suspect` (they are then recorded in export.json)."""
    suspect = refuse_suspects(dataset, source, skip_suspect)
    layers = stored_layers(dataset)
    selection = export_format.select(layers)
    report = ExportReport(
        export_format.name,
        export_format.method,
        out.url,
        target_layer_ids=list(selection.trainer_layer_ids),
        layer_ids_key=export_format.layer_ids_key,
        trainer=export_format.trainer_fields(layers, selection),
        bad_shards=list(dataset.bad_shards),
        suspect_shards=suspect,
        dropped=Counter(dataset.dropped),
    )
    order = list(range(len(dataset)))
    if export_format.shuffled:
        random.Random(seed).shuffle(order)
    table = SpeculatorsTable() if isinstance(export_format, Speculators) else None
    try:
        with tempfile.NamedTemporaryFile("w+", prefix="dfq-export-index-", suffix=".jsonl") as index_file:
            for position in order:
                item = dataset[position]
                if on_sample is not None:
                    on_sample(1)
                reason = export_format.skip_reason(item)
                if reason is not None:
                    report.skipped[reason] += 1
                    continue
                name = export_format.file_name(report.samples)
                data = export_format.encode(item, selection)
                out.write_bytes(name, data)
                if table is not None:
                    table.add(item["input_ids"], item["loss_mask"])
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
            index_file.flush()
            out.write_file(INDEX, Path(index_file.name))
        extra_files = table.finish(out) if table is not None else []
        if table is not None and isinstance(export_format, Speculators):
            vocabulary = export_format.vocabulary_fields(f"{out.url.rstrip('/')}/{TOKEN_FREQ}", len(table.token_freq))
            report.trainer["arguments"] = [*report.trainer["arguments"], *vocabulary.pop("arguments")]
            report.trainer.update(vocabulary)
    finally:
        if table is not None:
            table.close()
    written = [layers.states[k] for k in selection.context] + (
        [layers.states[selection.last]] if selection.last is not None else []
    )
    manifest = {
        "format": export_format.name,
        "method": export_format.method,
        "source": source,
        "target_model": dataset.target_model,
        "num_model_layers": layers.num_layers,
        "hidden_size": dataset.hidden_size,
        "layer_ids": report.target_layer_ids,
        "layer_convention": export_format.layer_convention,
        export_format.layer_ids_key: report.target_layer_ids,
        # What each file holds, in order: the context layers, then the trainer's last state (if it reads one).
        "file_entries": written,
        "trainer": report.trainer,
        "source_layer_ids": list(layers.layer_ids),
        "source_layer_states": list(layers.states),
        "source_layer_convention": DECODER_LAYER_OUTPUT,
        "hidden_dtype": str(dataset.hidden_dtype).removeprefix("torch."),
        "shuffle_seed": seed if export_format.shuffled else None,
        "num_samples": report.samples,
        "num_tokens": report.tokens,
        "filtered": dict(report.dropped),
        "left_out": dict(report.skipped),
        "extra_files": extra_files,
        "bad_shards": [{"shard": key, "problem": problem} for key, problem in report.bad_shards],
        # Shards the reference audit found suspect, left out (skip_suspect): their states may not be the model's.
        "suspect_shards": [{"shard": key, "mark": mark} for key, mark in report.suspect_shards],
    }
    out.write_bytes(MANIFEST, json.dumps(manifest, indent=2).encode())
    return report


def hidden_dtype_named(name: str) -> torch.dtype:
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]
