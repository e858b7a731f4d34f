"""Exports of training shards to the layouts SpecForge's and vLLM speculators' trainers read."""

from dflash_queue.exports.formats import FORMAT_NAMES, METHODS, ExportFormat, ExportRefused, export_format
from dflash_queue.exports.sample_files import ExportReport, export_dataset
from dflash_queue.shards.layer_conventions import LayerConventionError, checked_layer_ids, convert_layer_ids

__all__ = [
    "FORMAT_NAMES",
    "METHODS",
    "ExportFormat",
    "ExportRefused",
    "ExportReport",
    "LayerConventionError",
    "checked_layer_ids",
    "convert_layer_ids",
    "export_dataset",
    "export_format",
]
