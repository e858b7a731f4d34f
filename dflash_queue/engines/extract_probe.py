"""The extract engine's load probe: is the way it runs this model exact?

Three sequences (one long enough to cross a small sliding window and a 64-token linear-attention chunk) run in
the chosen mode and each alone through the model's own attention. Packed and not exact: fall back to padded
batches and say so. Padded and not exact either: refuse the model before any task is taken. The outcome is
logged with the error measured, so every worker says how it extracts.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from dflash_queue.engines.architecture import ArchitectureProfile
from dflash_queue.engines.state_checks import compare_states, default_tolerance
from dflash_queue.errors import UnsupportedArchitecture

if TYPE_CHECKING:
    from dflash_queue.engines.hf_extract import HiddenStateExtractor

log = logging.getLogger("dflash_queue.engines.hf_extract")


def confirm_mode(extractor: HiddenStateExtractor) -> str:
    """Leave `extractor` in the first exact mode of (its mode, then padded) and return it; raise if none is."""
    from dflash_queue.engines.hf_extract import ExtractionRequest

    profile = extractor.profile
    lengths = [probe_length(profile), 9, 21]
    generator = torch.Generator().manual_seed(0)
    vocab = int(getattr(extractor.model.config, "vocab_size", 0) or 0) or 256
    requests = [
        ExtractionRequest(f"probe-{i}", torch.randint(0, vocab, (n,), generator=generator).tolist())
        for i, n in enumerate(lengths)
    ]
    tolerance = default_tolerance(extractor.dtype)
    reference = [extractor.reference_states(r) for r in requests]
    error = float("nan")
    for mode in ("packed", "padded") if extractor.mode == "packed" else ("padded",):
        extractor.use_mode(mode)
        budget, extractor.effective_token_budget = extractor.effective_token_budget, sum(lengths)
        try:
            got = extractor.extract(requests)
        finally:
            extractor.effective_token_budget = budget
        error = max(compare_states(g, r).worst for g, r in zip(got, reference))
        if error <= tolerance:
            log.info("extraction for %s: %s (probe: max relative error %.2e against sequences run alone)",
                     profile.text_model_type, mode_label(extractor, mode), error)
            return mode
        log.warning("extraction for %s: %s is not exact (probe: relative error %.2e > %.1e)",
                    profile.text_model_type, mode_label(extractor, mode), error, tolerance)
    raise UnsupportedArchitecture(
        f"{profile.text_model_type}: neither packed nor padded extraction reproduces a sequence run alone "
        f"(relative error {error:.2e} > {tolerance:.1e}); refusing to extract states that would be wrong"
    )


def mode_label(extractor: HiddenStateExtractor, mode: str) -> str:
    profile = extractor.profile
    if mode == "padded":
        return f"padded batches ({profile.why_padded or 'packing was not exact'}), {extractor.reference_attention} attention"
    linear = ", linear attention per sequence" if "linear attention" in profile.features else ""
    attention = "per-sequence attention" if extractor.attn_implementation == "sdpa" else extractor.attn_implementation
    return f"packed sequences ({attention}{linear})"


def probe_length(profile: ArchitectureProfile) -> int:
    """Long enough to cross a small sliding window and a linear-attention chunk (64 tokens)."""
    window = int(profile.features.get("sliding window", "0") or 0)
    return max(70, min(window + 5, 512))
