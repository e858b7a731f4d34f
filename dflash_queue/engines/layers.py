"""Which decoder layers' outputs to capture."""

from __future__ import annotations


def dflash_layer_ids(num_layers: int, num_draft_layers: int) -> list[int]:
    """The DFlash release's choice: the middle layer for one draft layer, else K layers spread evenly from
    layer 1 to layer N-3 (36 layers, K=5 -> [1, 9, 17, 25, 33])."""
    if num_layers < 1 or num_draft_layers < 1:
        raise ValueError("num_layers and num_draft_layers must be positive")
    if num_draft_layers == 1:
        return [num_layers // 2]
    start, end = 1, num_layers - 3
    if end - start + 1 < num_draft_layers:
        raise ValueError(f"cannot spread {num_draft_layers} layers over a {num_layers}-layer model")
    step = (end - start) / (num_draft_layers - 1)
    return [int(start + i * step + 0.5) for i in range(num_draft_layers)]


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
