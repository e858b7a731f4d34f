"""The extract engine's load probe: is the way it runs this model exact, and how much do its passes differ from a
sequence run alone by arithmetic alone (the canary's tolerance)?

Probe sequences long enough to exercise every token mixer the config declares (past the sliding window, past an
attention chunk, past a 64-token linear-attention chunk: `probe_length`) run alone through the model's own
attention (the reference). In the chosen mode, each then runs first in a pass of its own, where nothing can leak
into it: its difference from the reference is the pass's numerical noise, and the canary's tolerance is a multiple
of it (`state_checks.CanaryTolerance`: over the whole sample, its first tokens, and the worst single token). Then all run in one pass: a sequence that follows another within the
tolerance is exact. Packed and not exact: fall back to padded batches and say so. Padded and not exact either:
refuse the model before any task is taken. The outcome is logged with the errors measured, so every worker says
how it extracts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from dflash_queue.engines.architecture import PROVEN_PACKED, ArchitectureProfile, coverage_length
from dflash_queue.engines.base import CapturedStates, ExtractionRequest
from dflash_queue.engines.state_checks import CanaryTolerance, StateDifference, calibrate, compare_states
from dflash_queue.errors import UnsupportedArchitecture

log = logging.getLogger("dflash_queue.engines.hf.extract")
# Shorter than every probe sequence: put after one in a pass, it leaves the probe sequence first.
FILLER_TOKENS = 5


class ProbedExtractor(Protocol):
    """What the probe reads and sets of the Transformers extract engine (`extract.HiddenStateExtractor`)."""

    profile: ArchitectureProfile
    max_positions: int
    model: Any
    dtype: torch.dtype
    mode: str
    effective_token_budget: int
    attn_implementation: str
    reference_attention: str

    def use_mode(self, mode: str) -> None: ...

    def reference_states(self, request: ExtractionRequest, *, on_device: bool = False) -> torch.Tensor: ...

    def extract(self, requests: Sequence[ExtractionRequest]) -> list[torch.Tensor]: ...

    def capture(
        self, requests: Sequence[ExtractionRequest], *, deliver: Callable[[int, CapturedStates], None] | None = None
    ) -> list[CapturedStates]: ...


def confirm_mode(extractor: ProbedExtractor) -> tuple[str, CanaryTolerance]:
    """Leave `extractor` in the first exact mode of (its mode, then padded) and return it with the canary's
    tolerance calibrated in it; raise if no mode is exact."""
    profile = extractor.profile
    lengths = [probe_length(profile, extractor.max_positions), 9, 21]
    generator = torch.Generator().manual_seed(0)
    vocab = int(getattr(extractor.model.config, "vocab_size", 0) or 0) or 256
    requests = [
        ExtractionRequest(f"probe-{i}", torch.randint(0, vocab, (n,), generator=generator).tolist())
        for i, n in enumerate(lengths)
    ]
    filler = ExtractionRequest("probe-filler", torch.randint(0, vocab, (FILLER_TOKENS,), generator=generator).tolist())
    reference = [extractor.reference_states(r) for r in requests]
    error = float("nan")
    tolerance = CanaryTolerance.calibrated(extractor.dtype, 0.0, 0.0)
    modes = ("packed", "padded") if extractor.mode == "packed" else ("padded",)
    if modes[0] == "packed" and not probe_reaches(profile, lengths[0]):
        log.warning("extraction for %s: not proven packed, and the probe's %d tokens cannot reach past its mixers' "
                    "span of %d tokens within its %d positions: padded batches", profile.text_model_type,
                    lengths[0], coverage_length(profile), extractor.max_positions)
        modes = ("padded",)
    for mode in modes:
        extractor.use_mode(mode)
        budget, extractor.effective_token_budget = extractor.effective_token_budget, sum(lengths) + FILLER_TOKENS
        try:
            first = [
                compare_states(first_in_pass(extractor, request, filler), alone)
                for request, alone in zip(requests, reference)
            ]
            got = extractor.extract(requests)
        finally:
            extractor.effective_token_budget = budget
        differences = [compare_states(g, r) for g, r in zip(got, reference)]
        error = max(d.worst for d in differences)
        # Packed, a sequence first in its pass is computed as in any pass, with nothing before it to leak: its
        # difference from itself alone is the noise. Padded, no sequence follows another in its row; each is
        # padded to the longest of its batch, and its rounding changes with the batch's shape: the noise is the
        # batch's (the ceiling below still refuses a padded path that computes something else).
        tolerance = calibrate(extractor.dtype, first if mode == "packed" else first + differences)
        if tolerance.beyond_rounding(extractor.dtype):
            log.warning("extraction for %s: %s is not exact (probe: a sequence first in its pass differs from it "
                        "alone by %.2e, more than rounding)", profile.text_model_type, mode_label(extractor, mode),
                        tolerance.noise_whole)
            error = max(error, tolerance.noise_whole)
            continue
        if _within(differences, tolerance):
            log.info(
                "extraction for %s: %s (probe of %s tokens: max relative error %.2e against sequences run alone; "
                "canary tolerance %.1e whole sample, %.1e first tokens, %.1e per token, from a noise of %.1e / %.1e "
                "/ %.1e)",
                profile.text_model_type, mode_label(extractor, mode), "/".join(map(str, lengths)), error,
                tolerance.whole, tolerance.head, tolerance.token, tolerance.noise_whole, tolerance.noise_head,
                tolerance.noise_token,
            )
            return mode, tolerance
        log.warning("extraction for %s: %s is not exact (probe: relative error %.2e, first tokens %.2e, worst token "
                    "%.2e; tolerance %.1e / %.1e / %.1e)", profile.text_model_type, mode_label(extractor, mode), error,
                    max(d.worst_head for d in differences), max(d.worst_focus_token for d in differences),
                    tolerance.whole, tolerance.head, tolerance.token)
    raise UnsupportedArchitecture(
        f"{profile.text_model_type}: neither packed nor padded extraction reproduces a sequence run alone "
        f"(relative error {error:.2e} > {tolerance.whole:.1e}); refusing to extract states that would be wrong"
    )


def first_in_pass(extractor: ProbedExtractor, request, filler) -> torch.Tensor:
    """`request`'s states from a pass it opens (a shorter filler after it): what a pass computes with nothing
    before it."""
    found: dict[int, torch.Tensor] = {}

    def keep(index: int, captured) -> None:
        if index == 0:
            if captured.pass_position != 0:
                raise RuntimeError("the probe sequence did not open its pass")
            found[0] = captured.states

    extractor.capture([request, filler], deliver=keep)
    return found[0]


def _within(differences: list[StateDifference], tolerance: CanaryTolerance) -> bool:
    return all(
        d.worst <= tolerance.whole and d.worst_head <= tolerance.head and d.worst_focus_token <= tolerance.token
        for d in differences
    )


def mode_label(extractor: ProbedExtractor, mode: str) -> str:
    profile = extractor.profile
    if mode == "padded":
        return f"padded batches ({profile.why_padded or 'packing was not exact'}), {extractor.reference_attention} attention"
    linear = ", linear attention per sequence" if "linear attention" in profile.features else ""
    attention = "per-sequence attention" if extractor.attn_implementation == "sdpa" else extractor.attn_implementation
    return f"packed sequences ({attention}{linear})"


def probe_reaches(profile: ArchitectureProfile, probe_tokens: int) -> bool:
    """Whether packing may be confirmed by a probe of `probe_tokens`: the model type is proven packed by the
    conformance suite, or the probe reaches past every mixer's span."""
    return profile.text_model_type in PROVEN_PACKED or probe_tokens > coverage_length(profile)


def probe_length(profile: ArchitectureProfile, max_positions: int = 0) -> int:
    """Long enough to cross every mixer's reach (`coverage_length`) with a few tokens to spare, and at least 70;
    within the model's positions."""
    length = max(70, coverage_length(profile) + 6)
    return min(length, max_positions - 1) if max_positions > 1 else length
