"""The engine protocols of the two lanes. Engines take token ids: templating happens before.

A generate engine returns token ids; an extract engine returns each sequence's hidden states at the captured
layers. The generate lane has three implementations behind its protocol (Transformers, vLLM, inference servers:
`engines/hf`, `engines/vllm`, `engines/server`), the extract lane two (Transformers, vLLM).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from dflash_queue.engines.state_checks import CanaryTolerance


@dataclass(frozen=True)
class GenerationRequest:
    sample_id: str
    prompt_ids: list[int]
    # Per-request budget; None means the configured sampling.max_tokens.
    max_tokens: int | None = None
    # 0 on a first try; a retry (quality gate) has attempt 1 and must be sampled afresh, not replayed: engines
    # that seed per request mix the attempt into the seed.
    attempt: int = 0


@dataclass(frozen=True)
class Generation:
    sample_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    # "stop" (end-of-sequence token or stop string) or "length" (token budget exhausted).
    finish_reason: str
    text: str


def request_seed(base_seed: int, sample_id: str, attempt: int = 0) -> int:
    """The sampling seed of one request: fixed per sample (a re-delivered task regenerates the same reply),
    unrelated between samples (one shared seed would make every reply draw the same random numbers), and new
    for a quality-gate retry (which must be sampled afresh, not replayed)."""
    key = f"{base_seed}:{sample_id}" + (f"#{attempt}" if attempt else "")
    digest = hashlib.sha256(key.encode()).digest()
    return int.from_bytes(digest[:8], "little") & 0x7FFF_FFFF_FFFF_FFFF


class GenerateEngine(Protocol):
    name: str

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """One generation per request, in request order."""

    def close(self) -> None:
        """Release the model and any processes or device memory it holds."""


@dataclass(frozen=True)
class ExtractionRequest:
    sample_id: str
    input_ids: list[int]


@dataclass(frozen=True)
class CapturedStates:
    states: torch.Tensor  # [T, K, H] on the CPU, in the model's dtype
    # [K, 3] float32: per captured layer, the largest value, the smallest value and the median token RMS.
    summary: torch.Tensor
    # Where the sequence sat in its forward pass: 0 for the first (or only) one; a later one is where a leak
    # from the sequences before it would show.
    pass_position: int = 0


class ExtractEngine(Protocol):
    name: str  # "transformers" or "vllm"
    # How sequences shared the engine ("packed", "padded", "vllm"): the shard's `extraction` metadata.
    mode: str
    # What each of the K stored entries is: (decoder layer id, DECODER_OUTPUT or FINAL_NORM).
    captured: list[tuple[int, str]]
    num_model_layers: int
    hidden_size: int
    dtype: torch.dtype  # of the states it returns
    device: torch.device  # where `reference_states(..., on_device=True)` leaves them
    # Tasks that may capture at once (the lane's compute slots): 1 unless the engine batches across tasks.
    concurrent_tasks: int

    def capture(
        self,
        requests: Sequence[ExtractionRequest],
        *,
        deliver: Callable[[int, CapturedStates], None] | None = None,
    ) -> list[CapturedStates]:
        """States and statistics per request (request order), or each handed to `deliver` as it is ready."""

    def reference_states(self, request: ExtractionRequest, *, on_device: bool = False) -> torch.Tensor:
        """The states of one sequence run alone: what the canary compares a shared pass's result with."""

    def canary_tolerance(self) -> CanaryTolerance:
        """The canary's tolerance when extract.canary_tolerance is 0, calibrated when the engine loaded."""

    @property
    def pass_tokens(self) -> int:
        """Tokens one pass takes (what `run_together` may be given)."""

    def run_together(self, requests: Sequence[ExtractionRequest]) -> list[CapturedStates]:
        """These sequences in one pass, in this order: the later ones follow the earlier ones."""

    def coverage_length(self) -> int:
        """How far the model's token mixers reach (sliding window, attention chunk): a sequence longer than this
        exercises them; 0 when plain causal attention is all there is."""

    def close(self) -> None:
        """Release the model and any processes or device memory it holds."""
