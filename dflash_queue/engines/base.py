"""The generate-engine protocol. Engines take token ids and return token ids: templating happens before."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


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


class GenerateEngine(Protocol):
    name: str

    def generate(self, requests: Sequence[GenerationRequest]) -> list[Generation]:
        """One generation per request, in request order."""

    def close(self) -> None:
        """Release the model and any processes or device memory it holds."""
