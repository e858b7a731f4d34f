"""The ground truth extraction is held to: the checkpoint's own class, run on one sequence alone."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

DECODER_OUTPUT = "decoder_output"
FINAL_NORM = "final_norm"


def reference_model(path: str | Path, attention: str = "sdpa", dtype: torch.dtype = torch.float32):
    """The checkpoint's own class (`config.architectures[0]`, e.g. `Qwen3_5ForConditionalGeneration`)."""
    import transformers
    from transformers import AutoConfig

    architecture = AutoConfig.from_pretrained(path).architectures[0]
    model_class = getattr(transformers, architecture)
    return model_class.from_pretrained(path, dtype=dtype, attn_implementation=attention).eval()


def reference_states(model, input_ids: torch.Tensor, captured: Sequence[tuple[int, str]]) -> torch.Tensor:
    """[T, K, H] from the model's own forward over `input_ids` alone: decoder layer i's output is
    hidden_states[i + 1], except the last layer's, which only a hook sees (Transformers' last entry is after
    the final norm); a "final_norm" entry is that last entry."""
    last_layer: list[torch.Tensor] = []
    layers = model.get_decoder().layers
    hook = layers[-1].register_forward_hook(
        lambda _m, _i, out: last_layer.append(out[0] if isinstance(out, tuple) else out)
    )
    try:
        with torch.inference_mode():
            hidden = model(input_ids=input_ids[None].long(), output_hidden_states=True).hidden_states
    finally:
        hook.remove()
    num_layers = len(layers)
    entries = []
    for layer, kind in captured:
        if kind == FINAL_NORM:
            entries.append(hidden[num_layers][0])
        elif layer == num_layers - 1:
            entries.append(last_layer[0].reshape(hidden[0].shape)[0])
        else:
            entries.append(hidden[layer + 1][0])
    return torch.stack(entries, dim=1)


def assert_each_sample_exact(dataset, model, captured: Sequence[tuple[int, str]]) -> None:
    """Every stored sample's states against the model's own forward over it alone, to float32 rounding: relative L2
    error per layer over the sample, and over each token (a wrong token alone shows there). The reference's states
    must be large (scaled weights), so that a wrong answer shows."""
    from dflash_queue.engines.state_checks import compare_states

    for number in range(len(dataset)):
        item = dataset[number]
        want = reference_states(model, item["input_ids"], captured)
        assert float(want.abs().amax(dim=(0, 2)).min()) > 1.0
        difference = compare_states(item["hidden_states"], want)
        assert max(difference.relative) <= 1e-5 and max(difference.worst_token) <= 1e-4, difference
