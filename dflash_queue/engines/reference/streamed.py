"""The checkpoint's own forward, one decoder layer at a time: the truth stored states are held to.

The text decoder's own class runs its own forward (its masks, rotary embeddings, layer types, windows, sinks,
linear attention) over a right-padded batch of sequences, but only its small modules are resident: embeddings,
final norm and rotary tables are loaded by Transformers as usual (a copy of the config with no decoder layer),
while the decoder layers are built on the meta device. Just before layer i runs, its weights are read from the
checkpoint's safetensors files through Transformers' own loading (its renamings and conversions, such as
per-expert MoE weights fused as the class holds them), every weight checked; right after, they are dropped. The
memory is one decoder layer's weights plus the batch's activations, whatever the model's depth: a 27B target's
reference runs on host cores or a spare GPU beside the engine.

It shares no code with the engines whose states it checks (vLLM's model runner, the packed passes of
engines/hf/extract.py): only the checkpoint and Transformers' class.
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_queue.engines.architecture import profile_config
from dflash_queue.engines.decoder import (
    CheckpointLayout,
    checkpoint_keys,
    decoder_layers,
    decoder_prefix,
    load_kwargs,
    read_layout,
    require_complete,
)
from dflash_queue.errors import UnsupportedArchitecture
from dflash_queue.shards.training import FINAL_NORM

log = logging.getLogger(__name__)

_INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class StreamedRun:
    """One pass of the streamed forward: each sequence's states, and what the pass cost."""

    states: list[torch.Tensor]  # per sequence, [T, K, H] float32 on the CPU, in the captured entries' order
    tokens: int  # tokens of the sequences (padding left out)
    seconds: float
    load_seconds: float  # of which reading and converting layer weights


class StreamedDecoder:
    """The checkpoint at `path` run by its own class with one decoder layer resident at a time, on `device` (which
    may be changed between runs: nothing is kept on it)."""

    def __init__(self, path: str, *, device: torch.device | str = "cpu", layout: CheckpointLayout | None = None) -> None:
        self.path = str(path)
        self.device = torch.device(device)
        self.layout = layout or read_layout(self.path)
        text: Any = self.layout.text_config
        self.num_layers = int(text.num_hidden_layers)
        self.hidden_size = int(text.hidden_size)
        self.attention = profile_config(text).reference_attention
        self._layer_keys, self._files = _layer_weights(Path(self.path), self.layout, self.num_layers)

    def layer_bytes(self, dtype: torch.dtype = torch.float32) -> int:
        """The largest decoder layer's weights in `dtype`: what the streamed forward holds at once beyond the
        resident modules and the activations."""
        largest = 0
        with _open_files(Path(self.path), self._files) as handles:
            for keys in self._layer_keys.values():
                numel = 0
                for key in keys:
                    size = 1
                    for dim in handles[self._files[key]].get_slice(key).get_shape():
                        size *= dim
                    numel += size
                largest = max(largest, numel)
        return largest * torch.finfo(dtype).bits // 8

    def run(
        self, sequences: Sequence[Sequence[int]], captured: Sequence[tuple[int, str]], dtype: torch.dtype
    ) -> StreamedRun:
        """Each sequence's states at the `captured` entries ((decoder layer, kind): a layer's output, the last
        layer's before the final norm, or after it for FINAL_NORM), the model computing in `dtype`."""
        if not sequences or any(not sequence for sequence in sequences):
            raise ValueError("the streamed forward needs at least one sequence, none empty")
        for layer, _ in captured:
            if not 0 <= layer < self.num_layers:
                raise ValueError(f"layer {layer} is not a decoder layer of this {self.num_layers}-layer model")
        started = time.perf_counter()
        with _transformers_quiet(), _full_float32_matmuls():
            model, conversions = self._resident_modules(dtype)
            loading = _LayerLoader(self, model, conversions, dtype)
            try:
                states = self._forward(model, loading, sequences, captured)
            finally:
                loading.close()
                del model
        return StreamedRun(states, sum(len(s) for s in sequences), time.perf_counter() - started, loading.seconds)

    def _resident_modules(self, dtype: torch.dtype) -> tuple[Any, list[Any]]:
        """The decoder with its small modules loaded (every weight checked) and its layers on the meta device, and
        Transformers' weight conversions for its class."""
        from transformers import AutoModel
        from transformers.conversion_mapping import get_model_conversion_mapping

        text: Any = self.layout.text_config
        kwargs = load_kwargs(self.layout, dtype, self.device, self.attention)
        no_layers = copy.deepcopy(text)
        no_layers.num_hidden_layers = 0  # layer_types stay whole: the class sets up every kind's masks and tables
        kwargs["config"] = no_layers
        model, info = AutoModel.from_pretrained(self.path, output_loading_info=True, **kwargs)
        require_complete(model, info, self.path, self.layout)
        full = copy.deepcopy(text)
        full._attn_implementation = model.config._attn_implementation
        with torch.device("meta"):
            skeleton = AutoModel.from_config(full, dtype=dtype)
        model.layers = decoder_layers(skeleton)
        model.config.num_hidden_layers = self.num_layers
        model.eval()
        return model, get_model_conversion_mapping(skeleton, kwargs.get("key_mapping"), None)

    def _forward(
        self, model: Any, loading: _LayerLoader, sequences: Sequence[Sequence[int]], captured: Sequence[tuple[int, str]]
    ) -> list[torch.Tensor]:
        wanted: dict[int, int] = {}  # decoder layer -> its slot among the kept outputs
        for layer, kind in captured:
            if kind != FINAL_NORM:
                wanted.setdefault(layer, len(wanted))
        kept: dict[int, torch.Tensor] = {}
        layers = decoder_layers(model)

        def before(index: int):
            def hook(module, _args) -> None:
                loading.load(index, module)

            return hook

        def after(index: int):
            def hook(module, _args, output) -> None:
                if index in wanted:
                    state = output[0] if isinstance(output, tuple) else output
                    kept[index] = state.detach().float().cpu()
                loading.drop(module)

            return hook

        hooks = []
        for index, module in enumerate(layers):
            hooks.append(module.register_forward_pre_hook(before(index)))
            hooks.append(module.register_forward_hook(after(index)))
        lengths = [len(s) for s in sequences]
        longest = max(lengths)
        ids = torch.zeros(len(sequences), longest, dtype=torch.long)
        mask = torch.zeros(len(sequences), longest, dtype=torch.long)
        for row, sequence in enumerate(sequences):
            ids[row, : len(sequence)] = torch.tensor(list(sequence), dtype=torch.long)
            mask[row, : len(sequence)] = 1
        try:
            with torch.inference_mode():
                output = model(
                    input_ids=ids.to(self.device), attention_mask=mask.to(self.device), use_cache=False
                )
        finally:
            for hook in hooks:
                hook.remove()
        final = output.last_hidden_state.detach().float().cpu()
        out = []
        for row, length in enumerate(lengths):
            entries = [
                final[row, :length] if kind == FINAL_NORM else kept[layer][row, :length]
                for layer, kind in captured
            ]
            out.append(torch.stack(entries, dim=1))
        return out


class _LayerLoader:
    """Reads one decoder layer's weights into the meta skeleton and drops them again."""

    def __init__(self, decoder: StreamedDecoder, model: Any, conversions: list[Any], dtype: torch.dtype) -> None:
        from transformers.modeling_utils import LoadStateDictConfig

        self.decoder = decoder
        self.model = model
        self.seconds = 0.0
        self._handles: dict[str, Any] = {}
        self._config = LoadStateDictConfig(
            dtype=dtype,
            dtype_plan=model._get_dtype_plan(dtype),
            device_map={"": str(decoder.device)},
            weight_mapping=conversions,
        )

    def load(self, index: int, module: torch.nn.Module) -> None:
        from safetensors import safe_open
        from transformers.core_model_loading import convert_and_load_state_dict_in_model

        started = time.perf_counter()
        decoder = self.decoder
        slices = {}
        for key in decoder._layer_keys.get(index, ()):
            name = decoder._files[key]
            if name not in self._handles:
                self._handles[name] = safe_open(str(Path(decoder.path) / name), framework="pt")
            slices[key] = self._handles[name].get_slice(key)
        info, _ = convert_and_load_state_dict_in_model(model=self.model, state_dict=slices, load_config=self._config)
        prefix = f"layers.{index}."
        missing = sorted(key for key in info.missing_keys if key.startswith(prefix))
        if missing or not slices:
            shown = ", ".join(missing[:6]) + (" ..." if len(missing) > 6 else "")
            raise UnsupportedArchitecture(
                f"{decoder.path}: decoder layer {index} loads with {len(missing)} weights missing "
                f"({shown or 'no weight of it in the checkpoint'}): the reference cannot run it"
            )
        still_meta = [name for name, tensor in module.state_dict().items() if tensor.is_meta]
        if still_meta:
            raise UnsupportedArchitecture(
                f"{decoder.path}: decoder layer {index} keeps {len(still_meta)} tensors unloaded ({', '.join(still_meta[:6])})"
            )
        self.seconds += time.perf_counter() - started

    def drop(self, module: torch.nn.Module) -> None:
        module.to("meta")

    def close(self) -> None:
        self._handles.clear()


def _layer_weights(directory: Path, layout: CheckpointLayout, num_layers: int) -> tuple[dict[int, list[str]], dict[str, str]]:
    """({decoder layer: its checkpoint keys}, {key: the safetensors file holding it})."""
    index = directory / _INDEX
    files: dict[str, str] = {}
    if index.is_file():
        files = dict(json.loads(index.read_text(encoding="utf-8"))["weight_map"])
    else:
        from safetensors import safe_open

        for file in sorted(directory.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as handle:
                files.update(dict.fromkeys(handle.keys(), file.name))
    if not files:
        raise UnsupportedArchitecture(f"{directory}: no safetensors weights to run the reference from")
    prefix = decoder_prefix(checkpoint_keys(directory), layout)
    pattern = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")
    per_layer: dict[int, list[str]] = {}
    for key in files:
        match = pattern.match(key)
        if match is not None and int(match.group(1)) < num_layers:
            per_layer.setdefault(int(match.group(1)), []).append(key)
    absent = [i for i in range(num_layers) if i not in per_layer]
    if absent:
        raise UnsupportedArchitecture(
            f"{directory}: the checkpoint holds no weights for decoder layer(s) {absent[:8]} under {prefix!r}"
        )
    return per_layer, files


@contextlib.contextmanager
def _open_files(directory: Path, files: dict[str, str]) -> Iterator[dict[str, Any]]:
    from safetensors import safe_open

    handles = {name: safe_open(str(directory / name), framework="pt") for name in set(files.values())}
    try:
        yield handles
    finally:
        handles.clear()


@contextlib.contextmanager
def _transformers_quiet() -> Iterator[None]:
    """Transformers' loading reports (the decoder layers' weights are left out of the first load on purpose) and
    its progress bars (one per streamed layer) left out; errors still shown."""
    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    names = ("transformers.modeling_utils", "transformers.utils.loading_report", "transformers.core_model_loading",
             "transformers.distributed.tensor_parallel")
    levels = {name: logging.getLogger(name).level for name in names}
    for name in names:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        yield
    finally:
        for name, level in levels.items():
            logging.getLogger(name).setLevel(level)
        if bars:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def _full_float32_matmuls() -> Iterator[None]:
    """float32 is float32 while the reference runs, whatever the process set (TF32 on a GPU)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)
