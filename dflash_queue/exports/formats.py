"""The per-sample file layouts of the trainers users already have, read by their own released loaders.

Each format picks, from the entries a shard stores (`layer_states`: the layers the drafter conditions on, the
last layer before the final norm, the last layer after it), those its trainer reads, in the order and
convention it reads them, and refuses shards that lack one, naming the extract setting that adds it: a file
with the wrong layer in the right place trains a drafter that accepts nothing.

SpecForge 0.2 (offline features; its `OfflineManifestReader` finds every `*.ckpt` under the directory and
`torch.load`s a dict):
  dflash   input_ids int64 [T], loss_mask int64 [T], hidden_states [T, K·H]: the K context layers concatenated
           in order, ids in this project's convention (it reads `hidden_states[layer_id + 1]`). Samples without
           two consecutive supervised tokens are left out (its normalizer refuses them).
  eagle3   input_ids, loss_mask, aux_hidden_state [T, 3·H] (exactly three context layers), hidden_state [T, H]:
           the last layer after the final norm (its target head applies only the LM head).

vLLM speculators 0.9 (`ArrowDataset`: a `datasets` table saved with `save_to_disk`, row i read with
`hidden_states/hs_{i}.safetensors` through hs-connectors' `FileTransfer`; see speculators_table.py):
  hs_{i}   token_ids int64 [T], hidden_states [T, K+1, H]: the K context layers, then the last decoder layer's
           output before the final norm, which speculators normalises with the verifier's own norm (EAGLE-3 and
           DFlash alike). Layer ids are vLLM's aux ids (this project's + 1); `--target-layer-ids` takes the K
           context layers, the last is implied.
"""

from __future__ import annotations

import io
import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save

from dflash_queue.errors import ConfigError
from dflash_queue.shards.layer_conventions import DECODER_LAYER_OUTPUT, VLLM_AUX_LAYER
from dflash_queue.shards.training import DECODER_OUTPUT, FINAL_NORM, LAST_LAYER

METHODS = ("dflash", "eagle3")

# How to get shards with the settings an export needs, from a job already run: its completions are kept.
REEXTRACT = (
    ", from the job's stored completions (nothing is generated again): `dflash-queue reextract -c NEW_CONFIG "
    "--from CONFIG`, NEW_CONFIG being the job's config with that setting and a storage.url and run.name of its own"
)


class ExportRefused(ConfigError):
    """The shards lack what the trainer reads (the message names the extract setting that adds it)."""


@dataclass(frozen=True)
class StoredLayers:
    """What the shards' entries are: decoder layer ids (this project's convention), their kinds, the model's depth."""

    layer_ids: tuple[int, ...]
    states: tuple[str, ...]
    num_layers: int

    def context(self) -> list[int]:
        """Positions of the layers the drafter conditions on (decoder-layer outputs)."""
        return [k for k, state in enumerate(self.states) if state == DECODER_OUTPUT]

    def position(self, kind: str) -> int | None:
        return next((k for k, state in enumerate(self.states) if state == kind), None)

    def last_before_norm(self) -> int | None:
        """The entry holding the last decoder layer's output before the final norm: the `last_layer` entry, else a
        context layer that is the last layer."""
        found = self.position(LAST_LAYER)
        if found is not None:
            return found
        return next((k for k in self.context() if self.layer_ids[k] == self.num_layers - 1), None)


@dataclass(frozen=True)
class Selection:
    """Which stored entries go where in the trainer's files."""

    context: tuple[int, ...]  # positions of the context layers, in the order written
    last: int | None  # position of the entry written as the trainer's last state, if it reads one
    # The layer ids the trainer is given, in its convention, and the config key it takes them under.
    trainer_layer_ids: tuple[int, ...]


class ExportFormat:
    name = ""
    method = ""
    layer_convention = DECODER_LAYER_OUTPUT
    layer_ids_key = ""
    # Files numbered in a seeded random order rather than the dataset's (a trainer that holds out its last rows).
    shuffled = False
    # Where the per-sample files go under OUT.
    subdir = ""

    def select(self, layers: StoredLayers) -> Selection:
        raise NotImplementedError

    def file_name(self, number: int) -> str:
        raise NotImplementedError

    def skip_reason(self, item: dict[str, Any]) -> str | None:
        """Why this sample cannot be given to the trainer (None: it can)."""
        return None

    def encode(self, item: dict[str, Any], selection: Selection) -> bytes:
        raise NotImplementedError

    def trainer_fields(self, layers: StoredLayers, selection: Selection) -> dict[str, Any]:
        """What to tell the trainer (config fields, command-line flags), for export.json."""
        return {}


def _context_ids(layers: StoredLayers, positions: Sequence[int]) -> list[int]:
    return [layers.layer_ids[k] for k in positions]


def _require_context(layers: StoredLayers, trainer: str) -> list[int]:
    context = layers.context()
    if not context:
        raise ExportRefused(
            f"{trainer} conditions the drafter on decoder layers, and these shards store none (layer_states "
            f"{list(layers.states)}): extract with extract.layer_ids or extract.num_draft_layers"
        )
    return context


class SpecForgeDFlash(ExportFormat):
    name, method, layer_ids_key = "specforge", "dflash", "dflash_config.target_layer_ids"

    def select(self, layers: StoredLayers) -> Selection:
        context = _require_context(layers, "SpecForge's DFlash trainer")
        return Selection(tuple(context), None, tuple(_context_ids(layers, context)))

    def file_name(self, number: int) -> str:
        return f"data_{number:08d}.ckpt"

    def skip_reason(self, item: dict[str, Any]) -> str | None:
        mask = item["loss_mask"].to(torch.bool)
        if not bool((mask[1:] & mask[:-1]).any()):
            return "fewer than two consecutive supervised tokens (SpecForge's DFlash reader refuses them)"
        return None

    def encode(self, item: dict[str, Any], selection: Selection) -> bytes:
        hidden = item["hidden_states"][:, list(selection.context)]
        return _torch_save({
            "input_ids": item["input_ids"].to(torch.int64),
            "loss_mask": item["loss_mask"].to(torch.int64),
            # Row-major [T, K, H] -> [T, K * H] is exactly the K layers concatenated in order.
            "hidden_states": hidden.reshape(hidden.shape[0], -1).contiguous(),
        })

    def trainer_fields(self, layers: StoredLayers, selection: Selection) -> dict[str, Any]:
        return {"model.draft_model_config.dflash_config.target_layer_ids": list(selection.trainer_layer_ids)}


class SpecForgeEagle3(ExportFormat):
    name, method, layer_ids_key = "specforge", "eagle3", "eagle_config.eagle_aux_hidden_state_layer_ids"

    def select(self, layers: StoredLayers) -> Selection:
        context = _require_context(layers, "SpecForge's EAGLE-3 trainer")
        n = layers.num_layers
        if len(context) != 3:
            raise ExportRefused(
                f"SpecForge's EAGLE-3 draft reads exactly 3 target layers (aux_hidden_state [T, 3·H]); these shards "
                f"store {len(context)} ({_context_ids(layers, context)}): extract with extract.layer_ids = "
                f"[1, {n // 2 - 1}, {n - 4}] (EAGLE-3's low, middle and high layers of {n})" + REEXTRACT
            )
        final = layers.position(FINAL_NORM)
        if final is None:
            raise ExportRefused(
                "SpecForge's EAGLE-3 trainer reads the target's last hidden state after the final norm "
                "(`hidden_state`, to which it applies only the LM head); these shards lack it: extract with "
                "extract.final_norm_state = true" + REEXTRACT
            )
        return Selection(tuple(context), final, tuple(_context_ids(layers, context)))

    def file_name(self, number: int) -> str:
        return f"data_{number:08d}.ckpt"

    def encode(self, item: dict[str, Any], selection: Selection) -> bytes:
        hidden = item["hidden_states"]
        aux = hidden[:, list(selection.context)]
        assert selection.last is not None
        return _torch_save({
            "input_ids": item["input_ids"].to(torch.int64),
            "loss_mask": item["loss_mask"].to(torch.int64),
            "aux_hidden_state": aux.reshape(aux.shape[0], -1).contiguous(),
            "hidden_state": hidden[:, selection.last].contiguous(),
        })

    def trainer_fields(self, layers: StoredLayers, selection: Selection) -> dict[str, Any]:
        ids = list(selection.trainer_layer_ids)
        return {
            "model.draft_model_config.eagle_config.eagle_aux_hidden_state_layer_ids": ids,
            "model.aux_hidden_state_layer_ids": ids,
        }


# The draft vocabulary a speculators export names when none is asked for: EAGLE-3's usual 32,000, or the number of
# distinct tokens the data supervises when it is smaller (a draft token never supervised is never learned, and
# speculators' mapping would fill the rest with arbitrary low ids; it also keeps the size within a small target's).
DEFAULT_DRAFT_VOCAB_SIZE = 32_000


class Speculators(ExportFormat):
    name, layer_convention, layer_ids_key = "speculators", VLLM_AUX_LAYER, "target_layer_ids"
    shuffled = True
    subdir = "hidden_states"

    def __init__(self, method: str, draft_vocab_size: int | None = None) -> None:
        if draft_vocab_size is not None and draft_vocab_size < 1:
            raise ValueError(f"draft vocabulary size {draft_vocab_size}: expected a positive number of tokens")
        self.method = method
        self.draft_vocab_size = draft_vocab_size

    def select(self, layers: StoredLayers) -> Selection:
        context = _require_context(layers, f"speculators' {self.method} trainer")
        last = layers.last_before_norm()
        if last is None:
            after = (
                " (their final_norm entry is after the norm: speculators would apply the norm a second time)"
                if layers.position(FINAL_NORM) is not None else ""
            )
            raise ExportRefused(
                "speculators applies the verifier's final norm to the last state of each file, so that state must be "
                f"decoder layer {layers.num_layers - 1}'s output before the norm (vLLM's aux layer "
                f"{layers.num_layers}); these shards lack it{after}: extract with extract.last_layer_state = true"
                + REEXTRACT
            )
        aux = tuple(layer + 1 for layer in _context_ids(layers, context))
        return Selection(tuple(context), last, aux)

    def file_name(self, number: int) -> str:
        return f"{self.subdir}/hs_{number}.safetensors"

    def skip_reason(self, item: dict[str, Any]) -> str | None:
        if not bool(item["loss_mask"].any()):
            return "no supervised token (speculators' data preparation drops these)"
        return None

    def encode(self, item: dict[str, Any], selection: Selection) -> bytes:
        assert selection.last is not None
        hidden = item["hidden_states"][:, [*selection.context, selection.last]]
        tensors = {"token_ids": item["input_ids"].to(torch.int64).contiguous(), "hidden_states": hidden.contiguous()}
        metadata = {"sample_id": item["sample_id"], "aux_layer_ids": json.dumps(list(selection.trainer_layer_ids))}
        return save(tensors, metadata=metadata)

    def trainer_fields(self, layers: StoredLayers, selection: Selection) -> dict[str, Any]:
        ids = list(selection.trainer_layer_ids)
        return {
            "speculator_type": self.method,
            "target_layer_ids": ids,
            # The verifier's last state, after the K layers in each file: vLLM's aux layer N.
            "verifier_last_layer": layers.num_layers,
            "data_path": ".",
            "hidden_states_path": self.subdir,
            "arguments": [
                "--speculator-type", self.method,
                "--target-layer-ids", *map(str, ids),
                "--on-missing", "raise",
            ],
        }

    def vocabulary_fields(self, token_freq_path: str, supervised_tokens: int) -> dict[str, Any]:
        """The draft vocabulary's trainer fields, once the export has counted the supervised tokens: the counts'
        file and the draft's size (without `--draft-vocab-size` speculators ignores the counts)."""
        size = self.draft_vocab_size or max(1, min(DEFAULT_DRAFT_VOCAB_SIZE, supervised_tokens))
        return {
            "token_freq_path": token_freq_path,
            "draft_vocab_size": size,
            "arguments": ["--token-freq-path", token_freq_path, "--draft-vocab-size", str(size)],
        }


def _torch_save(tensors: dict[str, torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensors, buffer)
    return buffer.getvalue()


FORMAT_NAMES = ("specforge", "speculators")


def export_format(name: str, method: str = "dflash", *, draft_vocab_size: int | None = None) -> ExportFormat:
    """`draft_vocab_size`: speculators' draft vocabulary (default: DEFAULT_DRAFT_VOCAB_SIZE, or the number of
    distinct supervised tokens when fewer)."""
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; expected one of {list(METHODS)}")
    if name == "specforge":
        return SpecForgeEagle3() if method == "eagle3" else SpecForgeDFlash()
    if name == "speculators":
        return Speculators(method, draft_vocab_size)
    raise ValueError(f"unknown export format {name!r}; expected one of {list(FORMAT_NAMES)}")
