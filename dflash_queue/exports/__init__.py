"""Exports of training shards to the per-sample layouts of SpecForge and vLLM speculators."""

from dflash_queue.exports.formats import FORMATS, ExportFormat
from dflash_queue.exports.runner import ExportReport, export_dataset
from dflash_queue.shards.layer_conventions import LayerConventionError, checked_layer_ids, convert_layer_ids

__all__ = [
    "FORMATS",
    "ExportFormat",
    "ExportReport",
    "LayerConventionError",
    "checked_layer_ids",
    "convert_layer_ids",
    "export_dataset",
]
