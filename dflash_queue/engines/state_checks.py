"""Checks that hidden states are what the target computes, run on every shard (not only in tests).

* The canary: a sample of the shard recomputed alone through the model's own attention and compared, token by
  token and layer by layer, with its packed result. Packing that leaks between sequences, a window or sink the
  packed path ignores, or a state that runs on into the next sequence all show here as a relative error far
  above rounding.
* Plausibility: states no forward pass gives. A layer that is all zero or constant for a sample, or whose
  median token RMS is far from the other samples' at that layer (the shape of a capture hook on the wrong
  module, a buffer never written, a layer skipped).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from dflash_queue.errors import PermanentError

# Largest relative error (whole sample, per layer) between a packed result and the same sequence run alone that
# rounding can explain, by the model's dtype. Measured on CPU: float32 ~1e-6, bfloat16 0 (the same kernels per
# row). A leak between sequences, an ignored window or a state running on into the next sequence gives 3e-2 to
# 1 even at random initialisation. Whole-sample rather than per-token, so that a mixture-of-experts router that
# picks another expert for one token after a rounding difference (possible where kernels depend on the pass
# size, as on GPUs) does not fail a shard; the worst token is recorded beside it.
_TOLERANCES = {torch.float32: 1e-4, torch.float64: 1e-8, torch.bfloat16: 2e-2, torch.float16: 5e-3}
# Below this many samples the shard has no meaningful median to compare a sample with.
MIN_SAMPLES_FOR_RMS_CHECK = 4


class CanaryMismatch(PermanentError):
    """A sample's packed states differ from the same sample run alone: the shard's states are not exact."""


class ImplausibleHiddenStates(PermanentError):
    """States that no forward pass of the target gives (all zero, constant, or an RMS far off the others)."""


def default_tolerance(dtype: torch.dtype) -> float:
    return _TOLERANCES.get(dtype, 1e-2)


@dataclass(frozen=True)
class StateDifference:
    relative: tuple[float, ...]  # per captured layer: |got - ref| / |ref| over the whole sample (L2)
    worst_token: tuple[float, ...]  # per captured layer: the largest per-token |got_t - ref_t| / |ref_t|

    @property
    def worst(self) -> float:
        return max(self.relative, default=0.0)


def compare_states(got: torch.Tensor, reference: torch.Tensor) -> StateDifference:
    """`got` and `reference` are one sample's [T, K, H] states."""
    if got.shape != reference.shape:
        raise ValueError(f"states of shape {tuple(got.shape)} compared with {tuple(reference.shape)}")
    tiny = torch.finfo(torch.float32).tiny
    difference = torch.linalg.vector_norm(got.float() - reference.float(), dim=-1)  # [T, K]
    scale = torch.linalg.vector_norm(reference.float(), dim=-1)
    relative = difference.square().sum(0).sqrt() / scale.square().sum(0).sqrt().clamp_min(tiny)
    worst_token = (difference / scale.clamp_min(tiny)).amax(dim=0)
    return StateDifference(tuple(relative.tolist()), tuple(worst_token.tolist()))


def check_canary(
    sample_id: str,
    packed: torch.Tensor,
    alone: torch.Tensor,
    layer_names: Sequence[str],
    tolerance: float,
) -> StateDifference:
    difference = compare_states(packed, alone)
    if difference.worst > tolerance:
        k = difference.relative.index(difference.worst)
        raise CanaryMismatch(
            f"canary sample {sample_id}: layer {layer_names[k]} differs from the sample run alone by relative error "
            f"{difference.worst:.3e} (worst token {difference.worst_token[k]:.3e}; tolerance {tolerance:.1e}): "
            "packed extraction is not exact for this model"
        )
    return difference


def check_plausible(
    sample_ids: Sequence[str], summaries: Sequence[torch.Tensor], layer_names: Sequence[str], rms_factor: float
) -> None:
    """`summaries[i]` is sample i's [K, 3] (largest value, smallest value, median token RMS) per layer."""
    if not summaries:
        return
    stacked = torch.stack(list(summaries))  # [N, K, 3]
    problems = []
    constant = stacked[..., 0] == stacked[..., 1]  # [N, K]: largest value == smallest (zero included)
    for i, k in constant.nonzero().tolist():
        high = float(stacked[i, k, 0])
        what = "all zero" if high == 0 else f"constant ({high:g})"
        problems.append(f"sample {sample_ids[i]}, layer {layer_names[k]}: {what}")
    if len(sample_ids) >= MIN_SAMPLES_FOR_RMS_CHECK:
        rms = stacked[..., 2]  # [N, K]
        typical = rms.median(dim=0).values
        ratio = rms / typical.clamp_min(torch.finfo(torch.float32).tiny)
        outside = ((ratio > rms_factor) | (ratio < 1 / rms_factor)) & ~constant & (typical > 0)
        for i, k in outside.nonzero().tolist():
            problems.append(
                f"sample {sample_ids[i]}, layer {layer_names[k]}: median token RMS {float(rms[i, k]):.3g} is "
                f"{float(ratio[i, k]):.3g} x the shard's median {float(typical[k]):.3g}"
            )
    if problems:
        raise ImplausibleHiddenStates(
            f"{len(problems)} implausible hidden states: " + "; ".join(problems[:5])
            + (" ..." if len(problems) > 5 else "")
        )
