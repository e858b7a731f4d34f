#!/usr/bin/env python
"""Peak host memory of an extract task against the size of the shard it writes, at three shard sizes.

Builds a random-weight Qwen3 model of hidden size 4096 with few layers (nothing is downloaded), then runs the
real extract lane (ExtractLane.run: forward passes, checks, the streamed shard writer, the local uploader) on
one shard of N samples x --tokens tokens for each N in --samples, capturing K=5 layers stored as bfloat16 from
a float32 model on the CPU. Each size runs in a fresh subprocess, which first extracts a 2-sample shard (not
measured, so that one-time allocations are in the baseline) and then polls its own RSS every few
milliseconds while the measured shard is extracted:

    growth = peak RSS during the task - RSS just before it

Target: growth / shard bytes <= 0.25 at the largest size, and growth not rising with the shard (a task holds
about one forward pass of states, see lanes/extract.py). "estimate" is what `dflash-queue plan` reports for
the computing task (ops/shard_sizing.py) plus the forward pass's activations, which a CPU model keeps in host
memory.

    python tools/bench_extract_memory.py [--samples 8 32 96] [--tokens 384] [--token-budget 1024] [--layers 5]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

HIDDEN = 4096
PAGE = os.sysconf("SC_PAGE_SIZE")


def build_model(out: Path, layers: int) -> Path:
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=1024,
        hidden_size=HIDDEN,
        intermediate_size=512,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    Qwen3ForCausalLM(config).save_pretrained(out)
    return out


def rss() -> int:
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * PAGE


class PeakRss:
    """Polls this process's RSS in a thread (torch releases the GIL in its kernels)."""

    def __init__(self, interval_s: float = 0.002) -> None:
        self.interval_s = interval_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.interval_s)

    def __enter__(self) -> PeakRss:
        self.peak = rss()
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())


def measure_one(model: Path, work: Path, samples: int, tokens: int, token_budget: int) -> dict:
    import torch

    from dflash_queue.config import load_config
    from dflash_queue.lanes.extract import ExtractLane, build_extractor, extract_lane_settings
    from dflash_queue.ops.shard_sizing import size_shards
    from dflash_queue.shards.completions import CompletionRecord, encode_completions
    from dflash_queue.shards.keys import completions_key
    from dflash_queue.storage import open_storage
    from dfq_testing.configs import tiny_config_tables, write_config

    torch.set_num_threads(2)
    tables = tiny_config_tables(model, work / "store", "redis://127.0.0.1:9/0", work / "state")
    config = load_config(write_config(
        work / "config.toml", tables,
        dataset={"shard_size": samples},
        extract={"layer_ids": [0, 1, 2, 3, 4], "token_budget": token_budget, "hidden_dtype": "bfloat16"},
    ))
    storage = open_storage(config.storage)
    prompt = tokens // 6
    for shard, count in (("warmup", 2), ("measured", samples)):
        records = [
            CompletionRecord(f"{shard}-{i}", [(i + j) % 1000 + 3 for j in range(prompt)],
                             [(7 * i + j) % 1000 + 3 for j in range(tokens - prompt)], "stop", False, "")
            for i in range(count)
        ]
        storage.write_bytes(completions_key(shard), encode_completions(records))
    extractor = build_extractor(config)
    lane = ExtractLane(extract_lane_settings(config), extractor, storage)
    lane.run("warmup")
    gc.collect()
    before = rss()
    with PeakRss() as peak:
        summary = lane.run("measured")
    sizing = size_shards(
        config.extract, config.dataset, config.storage.uploader, config.model,
        num_layers=len(extractor.captured), hidden_size=extractor.hidden_size, tokens_per_sample=tokens,
    )
    activations = extractor.activation_bytes(token_budget)
    lane.close()
    return {
        "samples": samples,
        "tokens": tokens,
        "shard_bytes": summary.num_bytes,
        "growth": peak.peak - before,
        "estimate": sizing.task_host_bytes + activations,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, nargs="+", default=[8, 32, 96])
    parser.add_argument("--tokens", type=int, default=384, help="tokens per sample")
    parser.add_argument("--token-budget", type=int, default=1024, help="extract.token_budget")
    parser.add_argument("--layers", type=int, default=5, help="decoder layers of the random model (>= 5)")
    parser.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: measure one size
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.one is not None:
        with tempfile.TemporaryDirectory(prefix="dfq-bench-mem-") as tmp:
            print(json.dumps(measure_one(args.model, Path(tmp), args.one, args.tokens, args.token_budget)))
        return 0

    with tempfile.TemporaryDirectory(prefix="dfq-bench-mem-model-") as tmp:
        model = build_model(Path(tmp) / "model", args.layers)
        print(f"random Qwen3, hidden {HIDDEN}, {args.layers} layers, float32 on CPU; K=5 stored bfloat16; "
              f"token_budget {args.token_budget}", flush=True)
        rows = []
        for samples in args.samples:
            child = subprocess.run(
                [sys.executable, __file__, "--one", str(samples), "--model", str(model), "--tokens",
                 str(args.tokens), "--token-budget", str(args.token_budget)],
                capture_output=True, text=True, check=False,
            )
            if child.returncode:
                print(child.stderr[-3000:], file=sys.stderr)
                return child.returncode
            rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
            print(f"  measured {samples} samples", flush=True)

    print()
    print("| shard (samples x tokens) | shard bytes | peak RSS growth | growth / shard bytes | estimate (plan + activations) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['samples']} x {row['tokens']} | {row['shard_bytes'] / 1e6:,.0f} MB | {row['growth'] / 1e6:,.0f} MB "
              f"| {row['growth'] / row['shard_bytes']:.2f} | {row['estimate'] / 1e6:,.0f} MB |")
    largest = rows[-1]
    ratio = largest["growth"] / largest["shard_bytes"]
    print(f"\nlargest shard: growth / shard bytes = {ratio:.2f} (target <= 0.25): {'met' if ratio <= 0.25 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
