#!/usr/bin/env python
"""Padding efficiency of the extract engine's batch planning over a realistic length mix (CPU only, no model).

Sequences are prompt + completion: prompts 50-1,000 tokens and completions 100-4,000 tokens, both log-uniform
(many short, a long tail), seeded. Each shard of `--shard-size` samples is planned on its own, as the extract
lane does. Printed side by side, for the same sequences and token budget:

  packed      the engine's plan: sequences concatenated into rows of <= budget tokens, attention per sequence;
  bucketed    padded batches of similar lengths (rows x longest row <= budget), the previous plan;
  naive       padded batches of `--naive-batch` sequences in arrival order.

Padding efficiency = useful tokens / computed tokens (target >= 0.95). "Budget fill" is the mean share of the
budget a forward pass uses (small passes use the GPU less well). "Dense attention" is the share of the causal
attention work that would be useful if a pack attended as one causal block with a mask, rather than per
sequence: the reason the engine runs attention per sequence.

    .venv/bin/python tools/bench_padding.py [--samples 4096] [--shard-size 256] [--token-budget 16384]
"""

from __future__ import annotations

import argparse
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_queue.engines.packing import (  # noqa: E402
    attention_pairs,
    padded_tokens,
    padding_efficiency,
    plan_packs,
    plan_padded_batches,
)


def log_uniform(rng: random.Random, low: int, high: int) -> int:
    return int(round(math.exp(rng.uniform(math.log(low), math.log(high)))))


def length_mix(samples: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [log_uniform(rng, 50, 1000) + log_uniform(rng, 100, 4000) for _ in range(samples)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=4096)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--token-budget", type=int, default=16384)
    parser.add_argument("--naive-batch", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    lengths = length_mix(args.samples, args.seed)
    useful = sum(lengths)
    shards = [lengths[i : i + args.shard_size] for i in range(0, len(lengths), args.shard_size)]
    budget = args.token_budget

    packed_passes: list[int] = []
    dense_pairs = 0
    bucketed_computed = bucketed_passes = 0
    naive_computed = naive_passes = 0
    for shard in shards:
        for pack in plan_packs(shard, budget):
            tokens = sum(shard[i] for i in pack)
            packed_passes.append(tokens)
            dense_pairs += tokens * (tokens + 1) // 2
        batches = plan_padded_batches(shard, budget)
        bucketed_computed += padded_tokens(batches, shard)
        bucketed_passes += len(batches)
        naive = [list(range(i, min(i + args.naive_batch, len(shard)))) for i in range(0, len(shard), args.naive_batch)]
        naive_computed += padded_tokens(naive, shard)
        naive_passes += len(naive)

    print(
        f"{len(lengths)} sequences in {len(shards)} shards of {args.shard_size}, {useful} tokens "
        f"(mean {useful / len(lengths):.0f}, min {min(lengths)}, max {max(lengths)}), token budget {budget}"
    )
    rows = [
        ("packed", sum(packed_passes), len(packed_passes)),
        ("bucketed", bucketed_computed, bucketed_passes),
        (f"naive (batch {args.naive_batch})", naive_computed, naive_passes),
    ]
    for name, computed, passes in rows:
        print(
            f"{name:<18} padding efficiency {padding_efficiency(useful, computed):.4f}  "
            f"computed tokens {computed:>10}  forward passes {passes:>5}"
        )
    fill = sum(packed_passes) / (len(packed_passes) * budget)
    print(f"packed budget fill {fill:.4f} (mean tokens per pass {sum(packed_passes) / len(packed_passes):.0f})")
    print(
        f"dense attention: useful share {attention_pairs(lengths) / dense_pairs:.4f} of a pack-wide causal mask's "
        "query-key pairs (per-sequence attention computes only the useful ones)"
    )
    efficiency = padding_efficiency(useful, sum(packed_passes))
    print(f"padding efficiency (engine) {efficiency:.4f} target >= 0.95: {'ok' if efficiency >= 0.95 else 'MISSED'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
