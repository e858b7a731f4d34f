"""The per-sample file layouts of the trainers users already have.

SpecForge (DFlash offline features, read by its offline reader from `*.ckpt` files):
    torch.save({"input_ids": int64 [T], "loss_mask": int64 [T], "hidden_states": [T, K * H]})
    with the K layers concatenated along the hidden axis in layer order, and `target_layer_ids` counted as
    decoder-layer outputs (SpecForge selects `hidden_states[layer_id + 1]`), the same as this project.

vLLM speculators (`hs_{i}.safetensors`, the files its vLLM hidden-states connector writes):
    {"token_ids": int64 [T], "hidden_states": [T, K, H], "loss_mask": int64 [T]}
    with layer ids counted as vLLM's aux hidden-state layers (Transformers' `hidden_states` index, this
    project's id + 1). speculators reads `token_ids` and `hidden_states` and takes the last of the K layers as
    the verifier's final hidden state; `loss_mask` is extra, so that the export stands on its own.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import save

from dflash_queue.shards.layer_conventions import DECODER_LAYER_OUTPUT, HF_INDEX


@dataclass(frozen=True)
class ExportFormat:
    name: str
    layer_convention: str  # how the target counts layers
    layer_ids_key: str  # what the target's config calls the layer list

    def file_name(self, number: int) -> str:
        raise NotImplementedError

    def encode(self, item: dict[str, Any], layer_ids: list[int]) -> bytes:
        raise NotImplementedError


class SpecForgeFormat(ExportFormat):
    def __init__(self) -> None:
        super().__init__("specforge", DECODER_LAYER_OUTPUT, "dflash_config.target_layer_ids")

    def file_name(self, number: int) -> str:
        return f"data_{number:08d}.ckpt"

    def encode(self, item: dict[str, Any], layer_ids: list[int]) -> bytes:
        hidden = item["hidden_states"]
        buffer = io.BytesIO()
        torch.save(
            {
                "input_ids": item["input_ids"].to(torch.int64),
                "loss_mask": item["loss_mask"].to(torch.int64),
                # Row-major [T, K, H] -> [T, K * H] is exactly the K layers concatenated in order.
                "hidden_states": hidden.reshape(hidden.shape[0], -1).contiguous(),
            },
            buffer,
        )
        return buffer.getvalue()


class SpeculatorsFormat(ExportFormat):
    def __init__(self) -> None:
        super().__init__("speculators", HF_INDEX, "eagle_aux_hidden_state_layer_ids")

    def file_name(self, number: int) -> str:
        return f"hs_{number}.safetensors"

    def encode(self, item: dict[str, Any], layer_ids: list[int]) -> bytes:
        tensors = {
            "token_ids": item["input_ids"].to(torch.int64).contiguous(),
            "hidden_states": item["hidden_states"].contiguous(),
            "loss_mask": item["loss_mask"].to(torch.int64).contiguous(),
        }
        metadata = {
            "sample_id": item["sample_id"],
            "layer_ids": json.dumps(layer_ids),
            "layer_convention": self.layer_convention,
        }
        return save(tensors, metadata=metadata)


FORMATS: dict[str, ExportFormat] = {f.name: f for f in (SpecForgeFormat(), SpeculatorsFormat())}
