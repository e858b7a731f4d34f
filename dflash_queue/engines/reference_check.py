"""An extract engine's states against the checkpoint's own Transformers forward: the check at load (and in
`doctor`) that sees what the canary cannot.

The vLLM engine's canary compares the engine with itself, batched against alone: an error that is the same both
ways (a layer off by one, rows read from the wrong cache slots, a kernel of the model runner computing something
else) passes it. So when the engine loads, its states of a probe sequence are compared with the checkpoint's own
class run over the same tokens by Transformers: only the decoder layers the comparison needs are loaded
(`extract.vllm.reference_layers`), on a spare GPU of the worker's when one has room, else on the host CPU.

What "the same" means is measured, not assumed: the checkpoint's own class runs twice, in float32 (the truth) and
in the engine's dtype; the engine may differ from the truth by `ROUNDING_FACTOR` times what the checkpoint's own
class differs by in that dtype, and at least by the dtype's floor (`FLOORS`). On vLLM's CPU build the test
families stay below 3e-7 in float32 and below a few 1e-2 in bfloat16; a one-slot offset or a state of another
layer differs by 0.5-1.5.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_queue.engines.architecture import profile_config
from dflash_queue.engines.decoder import decoder_layers, load_text_decoder, read_layout
from dflash_queue.engines.state_checks import compare_states
from dflash_queue.errors import UnsupportedArchitecture
from dflash_queue.shards.training import FINAL_NORM

log = logging.getLogger(__name__)

ROUNDING_FACTOR = 4.0
FLOORS = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 2e-2, torch.float16: 1e-2}
# The probe sequence: long enough to be prefilled over two steps of a small engine and to pass a window, short
# enough for a host CPU to run the loaded layers of a large target over it in seconds.
PROBE_TOKENS = 96


class ReferenceMismatch(UnsupportedArchitecture):
    """The engine's states differ from the checkpoint's own forward by more than rounding explains."""


@dataclass(frozen=True)
class ReferenceComparison:
    names: tuple[str, ...]  # the captured entries compared
    errors: tuple[float, ...]  # the engine against the truth (the checkpoint's own class in float32), per entry
    rounding: tuple[float, ...]  # the checkpoint's own class in the engine's dtype against the truth, per entry
    bounds: tuple[float, ...]
    tokens: int
    layers_loaded: int
    architecture: str
    device: str
    dtype: torch.dtype
    seconds: float

    @property
    def worst(self) -> int:
        """The entry closest to (or furthest past) its bound."""
        return max(range(len(self.errors)), key=lambda k: self.errors[k] / self.bounds[k])

    @property
    def agrees(self) -> bool:
        return all(error <= bound for error, bound in zip(self.errors, self.bounds))

    def describe(self) -> str:
        k = self.worst
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"relative error {self.errors[k]:.2e} at layer {self.names[k]} against the checkpoint's own Transformers "
            f"forward ({self.architecture}, its first {self.layers_loaded} layers on {self.device}) over a probe of "
            f"{self.tokens} tokens, {len(self.names)} layer(s) compared (bound {self.bounds[k]:.1e}: "
            f"{ROUNDING_FACTOR:g} x the {self.rounding[k]:.1e} the checkpoint's own class differs by in {dtype}, at "
            f"least {FLOORS.get(self.dtype, 2e-2):.0e}; {self.seconds:.1f} s)"
        )


def entries_to_compare(captured: Sequence[tuple[int, str]], num_layers: int, budget: int) -> tuple[list[int], int]:
    """(indices of the captured entries the comparison covers, decoder layers to load): those within the first
    `budget` layers, at least the lowest captured one; the final-norm entry only when every layer is loaded."""
    lowest = min(layer for layer, _ in captured)
    load = min(num_layers, max(budget, lowest + 1))
    chosen = [
        k for k, (layer, kind) in enumerate(captured)
        if layer < load and (kind != FINAL_NORM or load == num_layers)
    ]
    return chosen, load


def reference_device(model_path: str, layers: int, tensor_parallel_size: int) -> torch.device:
    """A spare GPU (visible, beyond the engine's tensor-parallel group, which takes the first ones) with room for
    the loaded layers in float32 twice over, else the host CPU."""
    if not torch.cuda.is_available() or torch.cuda.device_count() <= tensor_parallel_size:
        return torch.device("cpu")
    spare = torch.device("cuda", tensor_parallel_size)
    free, _ = torch.cuda.mem_get_info(spare)
    return spare if free >= 2 * float32_bytes(model_path, layers) else torch.device("cpu")


def float32_bytes(model_path: str, layers: int) -> int:
    """Bytes of the checkpoint's tensors outside its decoder layers and in its first `layers` ones, in float32."""
    import re

    from safetensors import safe_open

    pattern = re.compile(r"\.layers\.(\d+)\.")
    total = 0
    for file in sorted(Path(model_path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            for key in handle.keys():
                match = pattern.search(key)
                if match is None or int(match.group(1)) < layers:
                    numel = 1
                    for size in handle.get_slice(key).get_shape():
                        numel *= size
                    total += 4 * numel
    return total


def compare_with_reference(
    model_path: str,
    captured: Sequence[tuple[int, str]],
    num_layers: int,
    dtype: torch.dtype,
    states: torch.Tensor,
    input_ids: Sequence[int],
    *,
    budget: int,
    device: torch.device | None = None,
) -> ReferenceComparison:
    """`states` ([T, K, H], the engine's for `input_ids`, in the `captured` entries' order) against the checkpoint's
    own forward over the same tokens, at the entries `entries_to_compare` picks."""
    started = time.perf_counter()
    chosen, load = entries_to_compare(captured, num_layers, budget)
    layout = read_layout(model_path)
    device = device or torch.device("cpu")
    # Transformers reports the weights of the layers left out as unexpected: they are left out on purpose.
    with _quiet("transformers.modeling_utils"):
        model = load_text_decoder(
            model_path,
            dtype=torch.float32,
            device=device,
            attn_implementation=profile_config(layout.config).reference_attention,
            layout=layout,
            num_layers=load,
        ).eval()
    entries = [captured[k] for k in chosen]
    try:
        truth = _forward(model, input_ids, entries)
        own = truth if dtype == torch.float32 else _forward(model.to(dtype), input_ids, entries)
    finally:
        del model
    engine = states[:, chosen].to(truth.device)
    errors = compare_states(engine, truth).relative
    rounding = compare_states(own, truth).relative
    floor = FLOORS.get(dtype, 2e-2)
    architecture = ",".join(getattr(layout.config, "architectures", None) or [layout.model_type])
    return ReferenceComparison(
        names=tuple(f"{layer} ({kind})" for layer, kind in entries),
        errors=tuple(errors),
        rounding=tuple(rounding),
        bounds=tuple(max(ROUNDING_FACTOR * r, floor) for r in rounding),
        tokens=len(input_ids),
        layers_loaded=load,
        architecture=architecture,
        device=str(device),
        dtype=dtype,
        seconds=time.perf_counter() - started,
    )


def require_agreement(comparison: ReferenceComparison, engine: str) -> None:
    """Raise ReferenceMismatch, naming the layer and the error, when the engine is beyond its bound anywhere."""
    if comparison.agrees:
        return
    beyond = [k for k in range(len(comparison.errors)) if comparison.errors[k] > comparison.bounds[k]]
    k = max(beyond, key=lambda i: comparison.errors[i] / comparison.bounds[i])
    raise ReferenceMismatch(
        f"{engine}: layer {comparison.names[k]} differs from the checkpoint's own forward by relative error "
        f"{comparison.errors[k]:.2e}, more than {str(comparison.dtype).removeprefix('torch.')} rounding explains "
        f"({len(beyond)} of {len(comparison.names)} layers compared beyond their bound; {comparison.describe()}): "
        "its states are not the model's (a layer off by one, rows read from the wrong cache slots, a kernel "
        "computing something else); refusing to start (extract.engine = 'transformers' runs the checkpoint's own "
        "class)"
    )


@contextlib.contextmanager
def _quiet(logger: str) -> Iterator[None]:
    """Warnings of `logger` left out (errors still shown) while the block runs."""
    named = logging.getLogger(logger)
    level = named.level
    named.setLevel(logging.ERROR)
    try:
        yield
    finally:
        named.setLevel(level)


def _forward(model: Any, input_ids: Sequence[int], entries: Sequence[tuple[int, str]]) -> torch.Tensor:
    """[T, K, H] float32 on the CPU: each entry's state from the model's forward over `input_ids` alone (a decoder
    layer's output from a hook on it; the final norm's from a hook on the decoder's `norm`)."""
    layers = decoder_layers(model)
    outputs: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(_module, _inputs, output) -> None:
            outputs[name] = (output[0] if isinstance(output, tuple) else output).detach()

        return hook

    hooks = []
    for layer, kind in entries:
        if kind == FINAL_NORM:
            hooks.append(model.norm.register_forward_hook(keep(FINAL_NORM)))
        else:
            hooks.append(layers[layer].register_forward_hook(keep(str(layer))))
    device = next(model.parameters()).device
    try:
        with torch.inference_mode():
            model(input_ids=torch.tensor([list(input_ids)], device=device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    found = [outputs[FINAL_NORM if kind == FINAL_NORM else str(layer)] for layer, kind in entries]
    return torch.stack([state.reshape(len(input_ids), -1).float().cpu() for state in found], dim=1)
