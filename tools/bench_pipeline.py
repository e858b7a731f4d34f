#!/usr/bin/env python
"""Queue overhead: the same job through Redis and real workers vs a direct in-process loop.

Both runs use the same engine code on the same shards; engines are loaded before timing starts (workers are
ready, the direct loop has its lanes built). Prints pipeline_time / direct_time; the target is <= 1.25.

    .venv/bin/python tools/bench_pipeline.py [--samples 64] [--model .cache/tiny-qwen3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_queue.config import load_config  # noqa: E402
from dflash_queue.data.readers import read_dataset  # noqa: E402
from dflash_queue.data.samples import Sample  # noqa: E402
from dflash_queue.lanes.extract import ExtractLane, build_extractor  # noqa: E402
from dflash_queue.lanes.generate import GenerateLane, build_generate_engine  # noqa: E402
from dflash_queue.ledger import DONE, Ledger  # noqa: E402
from dflash_queue.producer import Producer  # noqa: E402
from dflash_queue.queue.app import configure_app  # noqa: E402
from dflash_queue.queue.launcher import WorkerProcess  # noqa: E402
from dflash_queue.redis_server import RedisServer  # noqa: E402
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id  # noqa: E402
from dflash_queue.storage import open_storage  # noqa: E402
from dflash_queue.storage.keys import prompts_key  # noqa: E402
from dflash_queue.testing.configs import tiny_config_tables, write_config  # noqa: E402
from dflash_queue.testing.polling import wait_for_states  # noqa: E402
from dflash_queue.testing.tiny_model import build_tiny_model  # noqa: E402


def make_dataset(count: int, out: Path) -> Path:
    """`count` distinct prompts from the example files (numbered variants once they run out)."""
    rows = []
    for path in sorted((REPO / "examples").glob("*.jsonl")):
        rows.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    lines = []
    for index in range(count):
        row = json.loads(json.dumps(rows[index % len(rows)]))
        if index >= len(rows):
            turns = row.get("conversations") or row["messages"]
            key = "value" if "conversations" in row else "content"
            first_user = next(t for t in turns if t.get("from", t.get("role")) in ("human", "user"))
            first_user[key] += f" (variant {index // len(rows)})"
        lines.append(json.dumps(row))
    out.write_text("\n".join(lines) + "\n")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--shard-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "tiny-qwen3")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    model = build_tiny_model(args.model)
    with tempfile.TemporaryDirectory(prefix="dfq-bench-") as tmp_name, RedisServer(Path(tmp_name) / "redis") as redis:
        tmp = Path(tmp_name)
        dataset = make_dataset(args.samples, tmp / "prompts.jsonl")
        tables = tiny_config_tables(model, tmp / "queued", redis.url, tmp / "state")
        overrides = {
            "dataset": {"shard_size": args.shard_size, "thinking": "always"},
            "generate.sampling": {"max_tokens": args.max_tokens, "temperature": 0.8},
        }
        config = load_config(write_config(tmp / "bench.toml", tables, **overrides))
        app = configure_app(config)

        # Through the queues: workers ready first, then enqueue and wait for every shard to be done.
        env = {**os.environ}
        workers = [
            WorkerProcess(lane, Path(config.source), env, tmp / f"{lane}.log", hostname=f"{lane}@bench")
            for lane in ("generate", "extract")
        ]
        try:
            for worker in workers:
                worker.wait_ready(app, timeout=300)
            ledger = Ledger.from_url(redis.url, config.run.name)
            started = time.perf_counter()
            report = Producer(config, ledger).enqueue([dataset])
            wait_for_states(ledger, report.shard_ids, {DONE}, timeout=1800, workers=workers)
            pipeline_s = time.perf_counter() - started
        finally:
            for worker in workers:
                worker.stop()

        # Direct: the same lanes in one process, shard after shard, on fresh storage.
        direct_config = config.with_overrides(storage={"url": str(tmp / "direct")})
        storage = open_storage(direct_config.storage.url)
        generate = GenerateLane(direct_config, build_generate_engine(direct_config), storage)
        extract = ExtractLane(direct_config, build_extractor(direct_config), storage)
        samples = [s for s in read_dataset([dataset], max_record_bytes=1 << 20) if isinstance(s, Sample)]
        started = time.perf_counter()
        shard_ids = []
        for begin in range(0, len(samples), args.shard_size):
            shard = samples[begin : begin + args.shard_size]
            shard_id = prompt_shard_id(shard)
            storage.write_bytes(prompts_key(shard_id), encode_prompts(shard))
            generate.run(shard_id)
            extract.run(shard_id)
            shard_ids.append(shard_id)
        direct_s = time.perf_counter() - started
        assert shard_ids == report.shard_ids

    print(f"samples: {args.samples} in {len(shard_ids)} shards, max_tokens {args.max_tokens}")
    print(f"pipeline (Redis + 2 workers): {pipeline_s:.2f} s")
    print(f"direct in-process loop:       {direct_s:.2f} s")
    print(f"pipeline_time / direct_time = {pipeline_s / direct_s:.3f}  (target <= 1.25)")


if __name__ == "__main__":
    main()
