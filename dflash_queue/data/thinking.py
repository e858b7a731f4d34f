"""Whether a sample is generated with the model's thinking mode on."""

from __future__ import annotations

from dataclasses import replace

from dflash_queue.data.samples import Sample


def apply_thinking_policy(sample: Sample, policy: str) -> Sample:
    if policy == "always":
        return replace(sample, thinking=True)
    if policy == "never":
        return replace(sample, thinking=False)
    raise ValueError(f"unknown thinking policy {policy!r}")
