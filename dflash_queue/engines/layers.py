"""Which decoder layers' outputs to capture."""

from __future__ import annotations

from collections.abc import Sequence

from dflash_queue.shards.training import DECODER_OUTPUT, FINAL_NORM, LAST_LAYER


def dflash_layer_ids(num_layers: int, num_draft_layers: int) -> list[int]:
    """The DFlash release's `build_target_layer_ids`: the middle layer (N // 2) for one draft layer, else K
    layers spread evenly from layer 1 to layer N-3, `int(round(1 + i * (N - 4) / (K - 1)))` with Python's round,
    which takes ties to even (36 layers, K=5 -> [1, 9, 17, 25, 33]; 94 layers -> [1, 24, 46, 68, 91])."""
    if num_layers < 1 or num_draft_layers < 1:
        raise ValueError("num_layers and num_draft_layers must be positive")
    if num_draft_layers == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    if end - start + 1 < num_draft_layers:
        raise ValueError(f"cannot spread {num_draft_layers} layers over a {num_layers}-layer model")
    span = end - start
    # Not `int(x + 0.5)`: DFlash reads round(68.5) == 68, and a layer off by one is a different feature.
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def eagle3_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's low, middle and high layers."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def resolve_layer_ids(explicit: tuple[int, ...], num_layers: int, num_draft_layers: int) -> list[int]:
    """Explicit ids from config win; otherwise the DFlash default. Ids must exist in the model."""
    layer_ids = list(explicit) if explicit else dflash_layer_ids(num_layers, num_draft_layers)
    bad = [i for i in layer_ids if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"layer ids {bad} do not exist in a {num_layers}-layer model")
    return layer_ids


def captured_entries(
    layer_ids: Sequence[int], num_layers: int, *, last_layer_state: bool = False, final_norm_state: bool = False
) -> list[tuple[int, str]]:
    """What each stored entry is, in order: (decoder layer id, kind). The K layers' outputs, then the last
    layer's output before the final norm (extract.last_layer_state), then after it (extract.final_norm_state)."""
    entries = [(layer, DECODER_OUTPUT) for layer in layer_ids]
    if last_layer_state:
        entries.append((num_layers - 1, LAST_LAYER))
    if final_norm_state:
        entries.append((num_layers - 1, FINAL_NORM))
    return entries


def vllm_aux_ids_of_entries(entries: Sequence[tuple[int, str]], num_layers: int) -> list[int]:
    """vLLM's aux layer id of each stored entry, in the entries' order. vLLM's aux id k is the residual stream
    before decoder layer k (Transformers' hidden_states[k] for k < N): decoder layer i's output is aux id i + 1;
    the last layer's output before the norm is aux id N, and the final-norm entry is computed from it."""
    return [layer + 1 if kind == DECODER_OUTPUT else num_layers for layer, kind in entries]


def vllm_aux_layer_ids(entries: Sequence[tuple[int, str]], num_layers: int) -> list[int]:
    """The aux layers vLLM's extract_hidden_states caches for these entries: distinct and ascending, the order it
    caches them in whatever order they are asked for."""
    return sorted(set(vllm_aux_ids_of_entries(entries, num_layers)))
