"""The run planner: how many tokens a dataset will generate, how long that takes on N GPUs, and how much
storage its hidden states need, before a GPU-day is spent.

Prompts are counted exactly (every record read, de-duplicated and filtered like the producer does); prompt
tokens are counted with the target's tokenizer and chat template on a random sample and extrapolated with a
standard error. Output tokens come from the thinking policy's defaults (or a finished run's measured average),
because they cannot be known before generating them.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from dflash_queue.data.chat_template import ChatFormatter
from dflash_queue.data.config import DatasetConfig
from dflash_queue.data.samples import Sample
from dflash_queue.engines.config import ModelConfig
from dflash_queue.lanes.config import ExtractConfig
from dflash_queue.lanes.registry import PIPELINE

# Expected completion tokens per prompt before any measurement, capped by generate.sampling.max_tokens.
# Thinking replies of Qwen3-class models on chat data run to a few thousand tokens with a heavy tail (a third
# of them pass 2,048); direct replies to a few hundred.
DEFAULT_THINKING_TOKENS = 2048
DEFAULT_PLAIN_TOKENS = 512
# Per-GPU decode throughputs compared when none is given: a Transformers engine batching a few sequences and
# a continuously batched engine (vLLM) on a 27B-32B dense target on one H100/H200.
DEFAULT_THROUGHPUTS = (160.0, 1200.0)
BYTES_PER_VALUE = {"bf16": 2, "fp8": 1}


@dataclass(frozen=True)
class PromptStats:
    prompts: int  # valid, de-duplicated prompts: what the producer would enqueue
    duplicates: int
    bad_records: int
    sample_size: int
    mean_prompt_tokens: float
    std_prompt_tokens: float  # sample standard deviation
    thinking_share: float  # share of sampled prompts generated with thinking on

    @property
    def prompt_tokens(self) -> float:
        return self.prompts * self.mean_prompt_tokens

    @property
    def prompt_tokens_se(self) -> float:
        """Standard error of the extrapolated total, with the finite-population correction (0 when exact)."""
        n, total = self.sample_size, self.prompts
        if n >= total or n < 2:
            return 0.0
        return total * self.std_prompt_tokens / math.sqrt(n) * math.sqrt((total - n) / (total - 1))


def reservoir(items: Iterable[Sample], size: int, rng: random.Random) -> tuple[list[Sample], int]:
    """A uniform random sample of `size` items (all of them if fewer) and how many there were."""
    kept: list[Sample] = []
    seen = 0
    for item in items:
        seen += 1
        if len(kept) < size:
            kept.append(item)
        else:
            slot = rng.randrange(seen)
            if slot < size:
                kept[slot] = item
    return kept, seen


def count_prompts(
    dataset: DatasetConfig,
    model: ModelConfig,
    datasets: Sequence[Path],
    tokenizer,
    *,
    sample_size: int = 2000,
    seed: int = 0,
) -> PromptStats:
    """Read every record as the producer would; tokenise a random sample with the chat template."""
    from dflash_queue.prompt_staging import EnqueueReport, iter_samples

    report = EnqueueReport()
    sample, total = reservoir(iter_samples(dataset, model, datasets, report), sample_size, random.Random(seed))
    formatter = ChatFormatter(tokenizer)
    lengths = [len(formatter.prompt_ids(s.messages, enable_thinking=s.thinking, tools=s.tools)) for s in sample]
    n = len(lengths)
    mean = sum(lengths) / n if n else 0.0
    std = math.sqrt(sum((x - mean) ** 2 for x in lengths) / (n - 1)) if n > 1 else 0.0
    return PromptStats(
        prompts=total,
        duplicates=report.duplicates,
        bad_records=report.problems.total,
        sample_size=n,
        mean_prompt_tokens=mean,
        std_prompt_tokens=std,
        thinking_share=sum(s.thinking for s in sample) / n if n else 0.0,
    )


def policy_output_tokens(
    thinking_share: float,
    max_tokens: int,
    *,
    thinking_tokens: int = DEFAULT_THINKING_TOKENS,
    plain_tokens: int = DEFAULT_PLAIN_TOKENS,
) -> float:
    """Expected completion tokens per prompt from the thinking mix, each capped by the token budget."""
    return thinking_share * min(thinking_tokens, max_tokens) + (1 - thinking_share) * min(plain_tokens, max_tokens)


@dataclass(frozen=True)
class Measured:
    """A run's averages from the ledger counters (tasks record busy time per worker)."""

    samples: int
    output_tokens_per_sample: float | None
    # Per lane: the tokens that pace it (LaneSpec.work_counter) per busy worker-second; None before any.
    tokens_per_s: dict[str, float | None]


def measured_from_counters(counters: Mapping[str, int]) -> Measured:
    generating = next(spec for spec in PIPELINE if spec.paced_by == "generated")
    samples = counters.get(generating.samples_counter, 0)
    generated = counters.get(generating.work_counter, 0)
    rates: dict[str, float | None] = {}
    for spec in PIPELINE:
        name = spec.name
        work, busy_s = counters.get(spec.work_counter, 0), counters.get(spec.busy_counter, 0) / 1000
        rates[name] = work / busy_s if busy_s > 0 and work else None
    return Measured(
        samples=samples,
        output_tokens_per_sample=generated / samples if samples else None,
        tokens_per_s=rates,
    )


@dataclass(frozen=True)
class Schedule:
    prompts: int
    tokens: float  # tokens the engine must process (generated tokens for generation)
    tokens_per_s: float  # per worker
    gpus: int
    gpus_per_worker: int
    gpu_hours: float
    wall_s: float


def schedule(
    prompts: int, tokens_per_prompt: float, tokens_per_s: float, *, gpus: int, gpus_per_worker: int = 1
) -> Schedule:
    """Time to process `prompts x tokens_per_prompt` tokens at `tokens_per_s` per worker, with one worker per
    `gpus_per_worker` GPUs (a tensor-parallel group is one worker)."""
    if tokens_per_s <= 0:
        raise ValueError(f"tokens per second must be positive, got {tokens_per_s}")
    if gpus < gpus_per_worker or gpus % gpus_per_worker:
        raise ValueError(f"{gpus} GPUs do not split into workers of {gpus_per_worker} GPUs")
    workers = gpus // gpus_per_worker
    tokens = prompts * tokens_per_prompt
    worker_s = tokens / tokens_per_s
    return Schedule(
        prompts=prompts,
        tokens=tokens,
        tokens_per_s=tokens_per_s,
        gpus=gpus,
        gpus_per_worker=gpus_per_worker,
        gpu_hours=worker_s * gpus_per_worker / 3600,
        wall_s=worker_s / workers,
    )


def hidden_state_bytes(tokens: float, num_layers: int, hidden_size: int, bytes_per_value: int) -> float:
    """K layers x hidden size x bytes per value x tokens (prompt and completion: the drafter needs both)."""
    return tokens * num_layers * hidden_size * bytes_per_value


@dataclass(frozen=True)
class ModelShape:
    num_layers_kept: int
    hidden_size: int


def model_shape(model: ModelConfig, extract: ExtractConfig) -> ModelShape:
    """K (the entries stored per token: the layers extracted, plus the final-norm state when asked for) and the
    hidden size, from the model's config.json (its text config for a multimodal checkpoint)."""
    from transformers import AutoConfig

    from dflash_queue.engines.layers import resolve_layer_ids

    model_config = AutoConfig.from_pretrained(model.path)
    text = getattr(model_config, "text_config", None) or model_config
    layer_ids = resolve_layer_ids(extract.layer_ids, text.num_hidden_layers, extract.num_draft_layers)
    entries = len(layer_ids) + int(extract.last_layer_state) + int(extract.final_norm_state)
    return ModelShape(entries, text.hidden_size)
