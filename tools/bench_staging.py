#!/usr/bin/env python
"""Staging throughput: a synthetic ShareGPT file through the producer into a real private redis-server.

The producer does everything a real run does: read and parse, stable ids, exact-duplicate removal, thinking
policy, prompt-token counting with the target's tokenizer and chat template (length filter), prompt shard
writing to local storage, and one Celery message per shard. Side by side in the same run it times the read
and parse alone (no counting, no shards, no Redis) so the ratio shows what staging adds on top of reading.
Staging runs three times over the same file, each with a ledger of its own (so every run stages every shard
again): with every JSON line through the standard library (`jsoncodec.standard_library()`) and through orjson,
both in one process (`dataset.staging_processes = 1`), and through orjson with a pool of `--processes`
processes preparing the records. An untimed run over the first 4,096 lines warms up what a first run pays
once. Prints prompts/s, the producer process's CPU per prompt (with a pool, what bounds staging once there are
enough cores for the pool) and Redis's peak memory (INFO memory used_memory_peak). Targets: 1,000,000 prompts
in under 30 s, Redis under 50 MB.

    .venv/bin/python tools/bench_staging.py [--prompts 1000000] [--processes N] [--model .cache/tiny-qwen3]
        [--tokenizer PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import random
import resource
import sys
import tempfile
import time
from contextlib import nullcontext
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

import redis  # noqa: E402

from dflash_queue import jsoncodec  # noqa: E402
from dflash_queue.broker.redis_server import RedisServer  # noqa: E402
from dflash_queue.config import load_config  # noqa: E402
from dflash_queue.lanes.registry import GENERATE  # noqa: E402
from dflash_queue.producer import Producer  # noqa: E402
from dflash_queue.prompt_staging import EnqueueReport, iter_samples  # noqa: E402
from dflash_queue.queue.app import configure_app  # noqa: E402
from dflash_queue.runstate.ledger import Ledger  # noqa: E402
from dfq_testing.configs import tiny_config_tables, write_config  # noqa: E402
from dfq_testing.tiny_model import build_tiny_model  # noqa: E402

SUBJECTS = ["a binary search", "the French revolution", "photosynthesis", "a REST API", "compound interest",
            "sourdough bread", "black holes", "SQL joins", "the immune system", "a haiku about rain"]
ASKS = ["Explain {s} to a beginner.", "Write a Python function about {s}.", "What are common mistakes with {s}?",
        "Summarize {s} in three sentences.", "Compare {s} with something similar and list the trade-offs."]
SYSTEMS = ["You are a helpful assistant.", "Answer concisely.", "You are an expert tutor. Use examples."]


def make_dataset(path: Path, prompts: int, seed: int = 0) -> None:
    """`prompts` ShareGPT records: ~1% exact duplicates, a third with a system prompt, a tenth multi-turn."""
    rng = random.Random(seed)
    with open(path, "w", encoding="utf-8") as handle:
        for index in range(prompts):
            number = index if rng.random() > 0.01 else max(0, index - 1)
            subject = SUBJECTS[number % len(SUBJECTS)]
            ask = ASKS[(number // len(SUBJECTS)) % len(ASKS)].format(s=subject)
            turns = []
            if number % 3 == 0:
                turns.append({"from": "system", "value": SYSTEMS[number % len(SYSTEMS)]})
            if number % 10 == 0:
                turns += [{"from": "human", "value": f"Hi! Question {number} is coming."},
                          {"from": "gpt", "value": "Sure, go ahead."}]
            turns += [{"from": "human", "value": f"{ask} (case {number})"},
                      {"from": "gpt", "value": f"Here is an answer about {subject} for case {number}."}]
            handle.write(json.dumps({"id": f"s{index}", "conversations": turns}) + "\n")


def stage(config, url: str, dataset: Path, name: str, *, read_alone: bool = True) -> dict:
    """Read alone (in this process), then the whole producer into a ledger of its own; wall and CPU seconds."""
    started = time.perf_counter()
    read_report = EnqueueReport()
    if read_alone:
        for _ in iter_samples(config.dataset, config.model, [dataset], read_report, processes=1):
            pass
    read_s = time.perf_counter() - started

    started = time.perf_counter()
    cpu, main_cpu, pool_cpu = time.process_time(), time.thread_time(), _children_cpu()
    ledger = Ledger.from_url(url, f"{config.run.name}-{name.replace(' ', '-').replace(',', '')}")
    report = Producer(config, ledger).enqueue([dataset])
    return {
        "read_s": read_s, "read_samples": read_report.samples, "report": report,
        "staging_s": time.perf_counter() - started,
        "cpu": time.process_time() - cpu, "main_cpu": time.thread_time() - main_cpu,
        # The pool's processes, reaped when staging ends (the redis-server child still runs: not counted).
        "pool_cpu": _children_cpu() - pool_cpu,
    }


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=1_000_000)
    parser.add_argument("--shard-size", type=int, default=256)
    parser.add_argument("--processes", type=int, default=max(2, (os.cpu_count() or 2) - 1),
                        help="Pool processes of the third run (default: one per core but one, at least 2).")
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "tiny-qwen3")
    parser.add_argument("--tokenizer", type=Path, default=None, help="Count with this tokenizer instead.")
    parser.add_argument("--dataset", type=Path, default=None, help="Reuse (or create) the synthetic file here.")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    model = build_tiny_model(args.model)
    with tempfile.TemporaryDirectory(prefix="dfq-bench-staging-") as tmp_name:
        tmp = Path(tmp_name)
        dataset = args.dataset or tmp / "prompts.jsonl"
        if not dataset.exists():
            started = time.perf_counter()
            make_dataset(dataset, args.prompts)
            print(f"wrote {args.prompts} prompts ({dataset.stat().st_size / 1e6:.0f} MB) in "
                  f"{time.perf_counter() - started:.1f} s (not timed below)")
        with RedisServer(tmp / "redis") as server:
            tables = tiny_config_tables(model, tmp / "storage", server.url, tmp / "state")
            overrides = {"dataset": {"shard_size": args.shard_size, "thinking": "auto", "max_model_len": 4096,
                                     "generation_budget": 1024, "staging_processes": 1}}
            if args.tokenizer:
                overrides["model"] = {"tokenizer": str(args.tokenizer.resolve())}
            config = load_config(write_config(tmp / "bench.toml", tables, **overrides))
            overrides["dataset"] = {**overrides["dataset"], "staging_processes": args.processes}
            pooled = load_config(write_config(tmp / "pooled.toml", tables, **overrides))
            configure_app(config)
            client = redis.Redis.from_url(server.url)

            # Warm up what a first run pays once (template compilation, tokenizer, task imports), untimed.
            warmup = tmp / "warmup.jsonl"
            with open(dataset, "rb") as source:
                warmup.write_bytes(b"".join(itertools.islice(source, 4096)))
            stage(config, server.url, warmup, "warm-up")
            results = {}
            for codec in ("standard library", "orjson"):
                with jsoncodec.standard_library() if codec == "standard library" else nullcontext():
                    results[codec] = stage(config, server.url, dataset, codec)
            pool_name = f"orjson, {args.processes} processes"
            results[pool_name] = stage(pooled, server.url, dataset, pool_name, read_alone=False)
            memory = client.info("memory")
            queued = client.llen(GENERATE.queue)
            load = os.getloadavg()

    report = results["orjson"]["report"]
    print(f"prompts: {report.samples + report.duplicates} read, {report.duplicates} duplicates, "
          f"{report.too_long.total} too long, {report.staged} staged (thinking on for {report.thinking_on}), "
          f"{report.prompt_tokens} prompt tokens counted")
    print(f"shards: {report.shards} written per run, {queued} messages queued by the three runs")
    for name, result in results.items():
        staging_s = result["staging_s"]
        print(f"JSON through {name}:")
        if result["read_samples"]:
            read_s = result["read_s"]
            print(f"  read + parse + dedupe only: {read_s:.1f} s ({result['read_samples'] / read_s:,.0f} prompts/s)")
        print(f"  full staging:               {staging_s:.1f} s ({report.samples / staging_s:,.0f} prompts/s, "
              f"{result['cpu']:.1f} s CPU in the producer's process ({result['cpu'] / report.samples * 1e6:.1f} us "
              f"per prompt), {result['main_cpu']:.1f} s of it on the main thread)")
        if result["pool_cpu"]:
            print(f"  the pool's processes:       {result['pool_cpu']:.1f} s CPU "
                  f"({result['pool_cpu'] / report.samples * 1e6:.1f} us per prompt)")
        million_s = staging_s * 1_000_000 / (report.samples + report.duplicates)
        print(f"  1M prompts at this rate: {million_s:.1f} s; / 30 s target = {million_s / 30:.2f}")
    old, new, pool = results["standard library"], results["orjson"], results[pool_name]
    print(f"standard library / orjson: read {old['read_s'] / new['read_s']:.2f}x, "
          f"staging {old['staging_s'] / new['staging_s']:.2f}x; "
          f"one process / {args.processes} processes: staging {new['staging_s'] / pool['staging_s']:.2f}x")
    print(f"with the pool, the producer's process needs {pool['cpu'] / report.samples * 1e6:.1f} us of CPU per prompt: "
          f"at most {report.samples / pool['cpu']:,.0f} prompts/s however many cores prepare them")
    print(f"redis used_memory_peak: {memory['used_memory_peak'] / 1e6:.1f} MB (target < 50 MB); "
          f"used now {memory['used_memory'] / 1e6:.1f} MB")
    print(f"load average during the run (1/5/15 min): {load[0]:.2f} {load[1]:.2f} {load[2]:.2f} on {os.cpu_count()} cores")


if __name__ == "__main__":
    main()
