"""Hidden-state extraction: one prefill over exactly the generated ids, capturing K decoder layers by hooks.

Only the base model is loaded (no LM head), and layers above the highest captured one are dropped, so no
FLOP or byte is spent on what is thrown away. `output_hidden_states=True` would materialise every layer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoConfig, AutoModel

from dflash_queue.engines.devices import resolve_device, resolve_dtype
from dflash_queue.engines.layers import resolve_layer_ids


@dataclass(frozen=True)
class ExtractionRequest:
    sample_id: str
    input_ids: list[int]


def plan_batches(lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    """Indices grouped so that each batch's padded size (rows x longest row) fits the budget.

    Longest first, so similar lengths share a batch; a sequence longer than the budget runs alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    current: list[int] = []
    for index in order:
        width = lengths[current[0]] if current else lengths[index]
        if current and (len(current) + 1) * width > token_budget:
            batches.append(current)
            current = []
        current.append(index)
    if current:
        batches.append(current)
    return batches


class HiddenStateExtractor:
    name = "transformers"

    def __init__(
        self,
        model_path: str,
        *,
        layer_ids: Sequence[int] = (),
        num_draft_layers: int = 5,
        device: str = "auto",
        dtype: str = "bfloat16",
        token_budget: int = 16384,
        attn_implementation: str = "sdpa",
    ) -> None:
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        model_config = AutoConfig.from_pretrained(model_path)
        text_config = model_config.get_text_config()
        self.num_model_layers: int = text_config.num_hidden_layers
        self.hidden_size: int = text_config.hidden_size
        self.layer_ids = resolve_layer_ids(tuple(layer_ids), self.num_model_layers, num_draft_layers)
        self.token_budget = token_budget

        model = AutoModel.from_pretrained(model_path, dtype=self.dtype, attn_implementation=attn_implementation)
        self.model = _truncate_layers(model, max(self.layer_ids) + 1).to(self.device).eval()
        self._captured: dict[int, torch.Tensor] = {}
        self._hooks = [
            self._decoder_layers()[layer_id].register_forward_hook(self._capture_hook(position))
            for position, layer_id in enumerate(self.layer_ids)
        ]

    def extract(self, requests: Sequence[ExtractionRequest]) -> list[torch.Tensor]:
        """Hidden states [T, K, H] on the CPU, one per request, in request order, in the model's dtype."""
        out: list[torch.Tensor | None] = [None] * len(requests)
        lengths = [len(r.input_ids) for r in requests]
        for batch in plan_batches(lengths, self.token_budget):
            for index, states in zip(batch, self._forward([requests[i].input_ids for i in batch])):
                out[index] = states
        return out  # type: ignore[return-value]

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        del self.model
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @torch.inference_mode()
    def _forward(self, sequences: list[list[int]]) -> list[torch.Tensor]:
        width = max(len(s) for s in sequences)
        # Right padding: with causal attention, real tokens never see the padding after them.
        input_ids = torch.zeros((len(sequences), width), dtype=torch.long)
        attention = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, ids in enumerate(sequences):
            input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            attention[row, : len(ids)] = 1
        self._captured.clear()
        self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=attention.to(self.device),
            use_cache=False,
        )
        stacked = torch.stack([self._captured[k] for k in range(len(self.layer_ids))], dim=2)  # [B, L, K, H]
        self._captured.clear()
        return [stacked[row, : len(ids)].cpu() for row, ids in enumerate(sequences)]

    def _capture_hook(self, position: int):
        def hook(_module: nn.Module, _inputs, output) -> None:
            hidden = output[0] if isinstance(output, tuple) else output
            self._captured[position] = hidden

        return hook

    def _decoder_layers(self) -> nn.ModuleList:
        return self.model.layers


def _truncate_layers(model: nn.Module, keep: int) -> nn.Module:
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no decoder 'layers' list; this architecture is not supported")
    if keep < len(layers):
        model.layers = nn.ModuleList(list(layers)[:keep])
        model.config.num_hidden_layers = keep
        if getattr(model.config, "layer_types", None):
            model.config.layer_types = model.config.layer_types[:keep]
    return model
