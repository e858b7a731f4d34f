"""Checks that hidden states are what the target computes, run on every shard (not only in tests).

* The canary: a sample of the shard recomputed alone and compared, layer by layer, with its result from the
  shared pass, on two measures: the relative error over the whole sample, and over its first tokens
  (`HEAD_TOKENS`), right after the pack boundary, where a state carried over from the sequence before it (a
  convolution's or a recurrence's) lands and decays. A leak into a few tokens of a long sample is a small share
  of the whole sample's error and a large one of its head's. The tolerance of each is calibrated when the engine
  loads, in the production dtype and on the production device: the same sequences first in their pass (where
  nothing can leak into them) against alone, the numerical noise of the pass itself; the tolerance is a multiple
  of that noise, never below a floor per dtype (`TOLERANCE_FLOORS`) and never above a ceiling below what a sample
  given another token's or another sequence's states differs by (`TOLERANCE_CEILINGS`).
* The canary where the loss is: the largest relative error of any single token among the tokens that matter
  (`TokenFocus`: the sample's completion tokens, which the drafter is trained on, and every token past the prefix it
  shares with another sample of its shard, where two requests' states can differ at all), against a per-token
  bound calibrated the same way (`TOKEN_CALIBRATION_FACTOR`, `TOKEN_FLOORS`, `TOKEN_CEILINGS`). A trained model's
  states are dominated by a few tokens with massive activations (RMS 100-170x the median token's on
  SmolLM2-135M), so whole-sample errors hardly move when ordinary tokens are wrong, and a shared system prompt
  dilutes them further; a single token's own error does not dilute. The relative L2 over those tokens is recorded
  beside it.
* Plausibility: states no forward pass gives. A layer that is all zero or constant for a sample, or whose
  median token RMS is far from the other samples' at that layer (the shape of a capture hook on the wrong
  module, a buffer never written, a layer skipped).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from dflash_queue.errors import ConfigError, PermanentError

# The first tokens of a sample that a leak across its pack boundary reaches first.
HEAD_TOKENS = 8
# The canary's tolerance: this multiple of the noise measured at load, never below the floor of the dtype (whole
# sample, head). Floors are a few roundings of the dtype: on a CPU a shared pass gives bit-identical results in
# bfloat16 and within ~1e-6 in float32, and a leak between sequences, an ignored window or a state running on into
# the next sequence gives 1e-3 (a faint leak into the head) to 1 (a sequence seeing another).
CALIBRATION_FACTOR = 10.0
TOLERANCE_FLOORS = {
    torch.float32: (1e-5, 1e-5),
    torch.float64: (1e-8, 1e-8),
    torch.bfloat16: (2e-4, 2e-4),
    torch.float16: (1e-4, 1e-4),
}
# Never above this, whatever the noise: below the error of a sequence given another token's or another sequence's
# states (a one-token shift or a swap between requests: 0.5-1.4 relative; 1.2-1.5 on the test families in
# bfloat16), so that a calibration on a noisy engine cannot hide them.
TOLERANCE_CEILINGS = {torch.float32: 1e-2, torch.float64: 1e-5, torch.bfloat16: 0.25, torch.float16: 0.25}
# The per-token bound (the worst token among those that matter): this multiple of the worst per-token noise of the
# calibration, between a floor and a ceiling per dtype. The noise is already the largest of thousands of tokens, so
# the factor is smaller than the whole sample's. Measured in bfloat16 (2026-12-07): on a trained checkpoint
# (SmolLM2-135M-Instruct, 30 layers; tests/engines/test_canary_trained.py) one token's state computed by two
# implementations (vLLM's CPU build, the checkpoint's own class) differs by 0.06 at most, and from float32 by 0.10;
# a state swapped with another request's differs by 1.24-1.55 at its worst token past the shared prefix (a median
# of 0.9-1.0), where the whole sample moves by 0.07-0.10. On vLLM's CPU build Qwen3-Next (random weights, linear
# attention and experts whose choice flips batched) differs batched from alone by 0.27 at its worst token, a
# swapped request by 2.1-2.3 (tests/engines/vllm/test_vllm_extract_bfloat16.py). The bfloat16 floor covers a rounding
# that a calibration with bit-identical probes never saw; the ceiling lies below a swapped request's worst token,
# with room above Qwen3-Next's noise. (A layer given another's state, 0.48-0.63 at the worst token, is the same
# batched and alone: the canary never sees it, the load-time reference check does.)
TOKEN_CALIBRATION_FACTOR = 3.0
TOKEN_FLOORS = {torch.float32: 1e-4, torch.float64: 1e-7, torch.bfloat16: 0.1, torch.float16: 0.02}
TOKEN_CEILINGS = {torch.float32: 1e-2, torch.float64: 1e-5, torch.bfloat16: 0.6, torch.float16: 0.6}
# Above this difference (whole sample) between a sequence first in its pass and alone, the pass computes something
# else, not the same thing with other rounding (an ignored window reaches every sequence past it, the first one
# too): the mode is not exact and no tolerance is calibrated from it. Above the noise measured for each dtype (vLLM's
# CPU build batching Qwen3-Next in bfloat16, linear attention and MoE routing: a median of 1e-2 for a sequence
# batched against alone, at most 7.4e-2 in a calibration), below what a wrong computation gives (0.3-1.4).
NOISE_CEILINGS = {torch.float32: 1e-3, torch.float64: 1e-6, torch.bfloat16: 0.1, torch.float16: 0.1}
# Below this many samples the shard has no meaningful median to compare a sample with.
MIN_SAMPLES_FOR_RMS_CHECK = 4


@dataclass(frozen=True)
class CanaryTolerance:
    whole: float  # relative error over the whole sample, per layer
    head: float  # relative error over its first HEAD_TOKENS tokens, per layer
    token: float  # the largest relative error of one token among those that matter (TokenFocus), per layer
    noise_whole: float = 0.0  # what the calibration measured (first in pass, or batched, against alone)
    noise_head: float = 0.0
    noise_token: float = 0.0

    @classmethod
    def calibrated(
        cls, dtype: torch.dtype, noise_whole: float, noise_head: float, noise_token: float = 0.0
    ) -> CanaryTolerance:
        """CALIBRATION_FACTOR x the noise, between the dtype's floor and its ceiling (`TOLERANCE_FLOORS`,
        `TOLERANCE_CEILINGS`); the per-token bound TOKEN_CALIBRATION_FACTOR x its noise, between `TOKEN_FLOORS` and
        `TOKEN_CEILINGS`."""
        floor_whole, floor_head = TOLERANCE_FLOORS.get(dtype, (1e-2, 1e-2))
        ceiling = TOLERANCE_CEILINGS.get(dtype, 0.25)
        return cls(
            whole=min(max(CALIBRATION_FACTOR * noise_whole, floor_whole), ceiling),
            head=min(max(CALIBRATION_FACTOR * noise_head, floor_head), ceiling),
            token=min(max(TOKEN_CALIBRATION_FACTOR * noise_token, TOKEN_FLOORS.get(dtype, 0.1)),
                      TOKEN_CEILINGS.get(dtype, 0.6)),
            noise_whole=noise_whole,
            noise_head=noise_head,
            noise_token=noise_token,
        )

    @classmethod
    def fixed(cls, tolerance: float) -> CanaryTolerance:
        """The same bound on every measure, without a calibration (for what needs a tolerance and has no engine)."""
        return cls(whole=tolerance, head=tolerance, token=tolerance)

    def configured(self, tolerance: float, dtype: torch.dtype) -> CanaryTolerance:
        """extract.canary_tolerance: the same fixed bound on the whole sample and its first tokens; the per-token
        bound stays the calibrated one. Refused (ConfigError) above the dtype's ceiling (`TOLERANCE_CEILINGS`),
        the loosest tolerance a calibration gives."""
        ceiling = TOLERANCE_CEILINGS.get(dtype, 0.25)
        if tolerance > ceiling:
            raise ConfigError(
                f"extract.canary_tolerance = {tolerance:g} is above {ceiling:g}, the canary's ceiling in "
                f"{str(dtype).removeprefix('torch.')} (no calibration gives more): a tolerance that loose passes "
                f"states given another token's or another sequence's; set at most {ceiling:g}, or 0 to calibrate it"
            )
        return replace(self, whole=tolerance, head=tolerance)

    def beyond_rounding(self, dtype: torch.dtype) -> bool:
        """The calibration measured more than rounding explains (`NOISE_CEILINGS`)."""
        return self.noise_whole > NOISE_CEILINGS.get(dtype, 5e-2)

    def to_metadata(self) -> dict[str, float]:
        return {"tolerance": self.whole, "head_tolerance": self.head, "token_tolerance": self.token,
                "noise": self.noise_whole, "head_noise": self.noise_head, "token_noise": self.noise_token}


def calibrate(dtype: torch.dtype, differences: Sequence[StateDifference]) -> CanaryTolerance:
    """The tolerance from the differences of sequences first in their pass against the same sequences alone."""
    return CanaryTolerance.calibrated(
        dtype,
        max((d.worst for d in differences), default=0.0),
        max((d.worst_head for d in differences), default=0.0),
        max((d.worst_focus_token for d in differences), default=0.0),
    )


class CanaryMismatch(PermanentError):
    """A sample's packed states differ from the same sample run alone: the shard's states are not exact."""


class ImplausibleHiddenStates(PermanentError):
    """States that no forward pass of the target gives (all zero, constant, or an RMS far off the others)."""


@dataclass(frozen=True)
class TokenFocus:
    """The tokens of a sample whose states matter most to a per-token check: its completion tokens (the loss mask)
    and every token past the longest prefix its token ids share with another sample of its shard (up to there, the
    two are computed from the same tokens, so a swap between them cannot show)."""

    mask: torch.Tensor  # [T] bool
    shared_prefix: int = 0  # tokens the sample shares with another of its shard

    @classmethod
    def of(cls, length: int, loss_mask: Sequence[int] | torch.Tensor | None = None, shared_prefix: int = 0) -> TokenFocus:
        mask = torch.arange(length) >= shared_prefix
        if loss_mask is not None:
            loss = torch.as_tensor(loss_mask)
            if loss.shape != (length,):
                raise ValueError(f"a loss mask of {tuple(loss.shape)} for a sample of {length} tokens")
            mask |= loss.bool()
        return cls(mask, shared_prefix)

    @property
    def tokens(self) -> int:
        return int(self.mask.sum())


@dataclass(frozen=True)
class StateDifference:
    relative: tuple[float, ...]  # per captured layer: |got - ref| / |ref| over the whole sample (L2)
    worst_token: tuple[float, ...]  # per captured layer: the largest per-token |got_t - ref_t| / |ref_t|
    # per captured layer: |got - ref| / |ref| over the first HEAD_TOKENS tokens (L2)
    head: tuple[float, ...] = ()
    # per captured layer, over the tokens that matter (TokenFocus; every token when none was given): the largest
    # per-token relative error, the token it is at, and the relative L2 over them
    focus_token: tuple[float, ...] = ()
    focus_token_at: tuple[int, ...] = ()
    focus: tuple[float, ...] = ()
    focus_tokens: int = 0
    shared_prefix: int = 0

    @property
    def worst(self) -> float:
        return max(self.relative, default=0.0)

    @property
    def worst_head(self) -> float:
        return max(self.head, default=0.0)

    @property
    def worst_focus_token(self) -> float:
        return max(self.focus_token, default=0.0)


def compare_states(got: torch.Tensor, reference: torch.Tensor, focus: TokenFocus | None = None) -> StateDifference:
    """`got` and `reference` are one sample's [T, K, H] states; `focus` its tokens that matter (None: every token)."""
    if got.shape != reference.shape:
        raise ValueError(f"states of shape {tuple(got.shape)} compared with {tuple(reference.shape)}")
    tiny = torch.finfo(torch.float32).tiny
    difference = torch.linalg.vector_norm(got.float() - reference.float(), dim=-1)  # [T, K]
    scale = torch.linalg.vector_norm(reference.float(), dim=-1)
    relative = difference.square().sum(0).sqrt() / scale.square().sum(0).sqrt().clamp_min(tiny)
    head = difference[:HEAD_TOKENS].square().sum(0).sqrt() / scale[:HEAD_TOKENS].square().sum(0).sqrt().clamp_min(tiny)
    per_token = difference / scale.clamp_min(tiny)  # [T, K]
    worst_token = per_token.amax(dim=0)
    if focus is None:
        focus = TokenFocus(torch.ones(got.shape[0], dtype=torch.bool))
    if focus.mask.shape != (got.shape[0],):
        raise ValueError(f"a token focus of {tuple(focus.mask.shape)} for states of {got.shape[0]} tokens")
    mask = focus.mask.to(per_token.device)
    layers = got.shape[1]
    if focus.tokens:
        focused = torch.where(mask[:, None], per_token, torch.zeros_like(per_token))
        focus_token, focus_at = focused.max(dim=0)
        inside = mask[:, None].to(difference.dtype)
        focus_l2 = (difference.square() * inside).sum(0).sqrt() / (
            (scale.square() * inside).sum(0).sqrt().clamp_min(tiny)
        )
        focus_values = (tuple(focus_token.tolist()), tuple(focus_at.tolist()), tuple(focus_l2.tolist()))
    else:
        focus_values = ((0.0,) * layers, (0,) * layers, (0.0,) * layers)
    return StateDifference(
        tuple(relative.tolist()), tuple(worst_token.tolist()), tuple(head.tolist()), *focus_values,
        focus_tokens=focus.tokens, shared_prefix=focus.shared_prefix,
    )


def check_canary(
    sample_id: str,
    packed: torch.Tensor,
    alone: torch.Tensor,
    layer_names: Sequence[str],
    tolerance: CanaryTolerance,
    focus: TokenFocus | None = None,
) -> StateDifference:
    difference = compare_states(packed, alone, focus)
    head_failed = difference.worst_head > tolerance.head
    whole_failed = difference.worst > tolerance.whole
    # Named by where the error lives: in the first tokens (several times the whole sample's), or throughout.
    if head_failed and (not whole_failed or difference.worst_head > 2 * difference.worst):
        k = difference.head.index(difference.worst_head)
        raise CanaryMismatch(
            f"canary sample {sample_id}: layer {layer_names[k]}, first {HEAD_TOKENS} tokens, differs from the sample "
            f"run alone by relative error {difference.worst_head:.3e} (whole sample {difference.relative[k]:.3e}; "
            f"tolerance {tolerance.head:.1e}): something runs on across the pack boundary into this sequence"
        )
    if whole_failed:
        k = difference.relative.index(difference.worst)
        raise CanaryMismatch(
            f"canary sample {sample_id}: layer {layer_names[k]} differs from the sample run alone by relative error "
            f"{difference.worst:.3e} (worst token {difference.worst_token[k]:.3e}; tolerance {tolerance.whole:.1e}): "
            "extraction is not exact for this model"
        )
    if difference.worst_focus_token > tolerance.token:
        k = difference.focus_token.index(difference.worst_focus_token)
        where = (
            f"its completion and the tokens past the {difference.shared_prefix} it shares with another sample"
            if difference.shared_prefix else "every token, as it shares no prefix with another sample"
        )
        raise CanaryMismatch(
            f"canary sample {sample_id}: layer {layer_names[k]}, token {difference.focus_token_at[k]}, differs from "
            f"the sample run alone by relative error {difference.worst_focus_token:.3e} (the worst of the "
            f"{difference.focus_tokens} tokens that matter: {where}; relative error over them "
            f"{difference.focus[k]:.3e}, over the whole sample {difference.relative[k]:.3e}; per-token tolerance "
            f"{tolerance.token:.1e}): the state of this token is not what the sample computes alone"
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
