#!/usr/bin/env python
"""Generate-lane throughput on vLLM: the pipeline against offline vLLM and a one-shard-at-a-time worker.

The same prompts, with the same per-request seeds (so the same replies, token for token), three ways:

  (a) offline: one `LLM.generate` over all prompts at once, the upper bound;
  (b) pipeline: a real `dflash-queue worker generate` (vLLM engine, `--inflight` tasks at once) fed through
      Redis; timed from the start of enqueue until every shard is generated (extraction is not run);
  (c) naive: the same worker and queue with one task at a time, so each shard waits for its slowest reply.

Reply lengths are heavy-tailed: at temperature 1 the tiny model ends a reply with probability ~3% per token,
so lengths are roughly geometric (a shard of 64 has a longest reply several times its mean). Engines are
started before timing. Prints output tokens/s for each and the ratios b/a (target >= 0.85) and b/c (> 1).

    .venv/bin/python tools/bench_generate.py [--samples 1024] [--shard-size 64] [--inflight 3]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_pipeline import make_dataset  # noqa: E402

from dflash_queue.config import Config, load_config  # noqa: E402
from dflash_queue.data.readers import read_dataset  # noqa: E402
from dflash_queue.data.samples import Sample  # noqa: E402
from dflash_queue.engines.base import GenerationRequest  # noqa: E402
from dflash_queue.engines.chat import ChatFormatter  # noqa: E402
from dflash_queue.engines.vllm_generate import engine_args, prepare_environment, sampling_kwargs  # noqa: E402
from dflash_queue.ledger import GENERATED, Ledger  # noqa: E402
from dflash_queue.producer import Producer  # noqa: E402
from dflash_queue.queue.app import configure_app  # noqa: E402
from dflash_queue.queue.launcher import WorkerProcess  # noqa: E402
from dflash_queue.redis_server import RedisServer  # noqa: E402
from dflash_queue.testing.configs import tiny_config_tables, tiny_vllm_overrides, write_config  # noqa: E402
from dflash_queue.testing.polling import wait_for_states  # noqa: E402
from dflash_queue.testing.tiny_model import build_tiny_model  # noqa: E402


def through_queue(config: Config, dataset: Path, concurrency: int, log: Path) -> tuple[int, float]:
    """(output tokens, seconds) from enqueue until every shard is generated, with a ready vLLM worker."""
    app = configure_app(config)
    worker = WorkerProcess(
        "generate",
        Path(config.source),
        dict(os.environ),
        log,
        hostname=f"generate-{concurrency}@bench",
        extra_args=("--concurrency", str(concurrency)),
    )
    try:
        worker.wait_ready(app, timeout=600)
        ledger = Ledger.from_url(config.broker.url, config.run.name)
        started = time.perf_counter()
        report = Producer(config, ledger).enqueue([dataset])
        wait_for_states(ledger, report.shard_ids, {GENERATED}, timeout=7200, workers=[worker])
        elapsed = time.perf_counter() - started
        return ledger.counters()["generate_completion_tokens"], elapsed
    finally:
        worker.stop(timeout=120)


def offline(config: Config, samples: list[Sample]) -> tuple[list[int], float]:
    """(reply lengths, seconds) of one LLM.generate over every prompt, engine started before timing."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    prepare_environment(config)
    formatter = ChatFormatter(AutoTokenizer.from_pretrained(config.model.tokenizer_path))
    prompts = [TokensPrompt(prompt_token_ids=formatter.prompt_ids(s.messages, enable_thinking=s.thinking)) for s in samples]
    params = [
        SamplingParams(**sampling_kwargs(config.generate.sampling, GenerationRequest(s.id, p["prompt_token_ids"])))
        for s, p in zip(samples, prompts)
    ]
    llm = LLM(**{**engine_args(config), "disable_log_stats": True})
    try:
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
    finally:
        llm.llm_engine.engine_core.shutdown()
    return [len(o.outputs[0].token_ids) for o in outputs], elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument("--inflight", type=int, default=3, help="tasks in flight for (b)")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=768, help="cap on reply length (rarely reached)")
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "tiny-qwen3")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

    model = build_tiny_model(args.model)
    with tempfile.TemporaryDirectory(prefix="dfq-bench-gen-") as tmp_name, RedisServer(Path(tmp_name) / "redis") as redis:
        tmp = Path(tmp_name)
        dataset = make_dataset(args.samples, tmp / "prompts.jsonl")
        samples = [s for s in read_dataset([dataset], max_record_bytes=1 << 20) if isinstance(s, Sample)]

        def config_for(name: str) -> Config:
            tables = tiny_config_tables(model, tmp / name / "storage", redis.url, tmp / name / "state")
            overrides = {
                **tiny_vllm_overrides(max_num_seqs=args.max_num_seqs, inflight_tasks=args.inflight),
                "run": {"name": name, "state_dir": str(tmp / name / "state")},
                "dataset": {"shard_size": args.shard_size, "thinking": "always"},
                "generate.sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": args.max_tokens},
            }
            return load_config(write_config(tmp / f"{name}.toml", tables, **overrides))

        pipeline_tokens, pipeline_s = through_queue(config_for("pipeline"), dataset, args.inflight, tmp / "b.log")
        naive_tokens, naive_s = through_queue(config_for("naive"), dataset, 1, tmp / "c.log")
        lengths, offline_s = offline(config_for("offline"), samples)

    offline_tokens = sum(lengths)
    rates = {
        "a": offline_tokens / offline_s,
        "b": pipeline_tokens / pipeline_s,
        "c": naive_tokens / naive_s,
    }
    shards = -(-len(samples) // args.shard_size)
    ordered = sorted(lengths)
    print(
        f"job: {len(samples)} prompts in {shards} shards of {args.shard_size}; max_num_seqs {args.max_num_seqs}; "
        f"reply lengths mean {statistics.mean(lengths):.0f}, p50 {ordered[len(ordered) // 2]}, "
        f"p99 {ordered[int(len(ordered) * 0.99)]}, max {ordered[-1]} tokens"
    )
    same = "same replies in all three" if offline_tokens == pipeline_tokens == naive_tokens else "TOKEN COUNTS DIFFER"
    print(f"output tokens: a {offline_tokens}, b {pipeline_tokens}, c {naive_tokens} ({same})")
    print(f"(a) offline LLM.generate, all prompts at once:        {offline_s:7.2f} s  {rates['a']:8.0f} tok/s")
    print(f"(b) pipeline, vLLM worker, {args.inflight} tasks in flight:      {pipeline_s:7.2f} s  {rates['b']:8.0f} tok/s")
    print(f"(c) naive worker, one shard at a time:                {naive_s:7.2f} s  {rates['c']:8.0f} tok/s")
    print("    (b) and (c): from enqueue to every shard generated, through Redis; extraction not run")
    print(f"b/a = {rates['b'] / rates['a']:.3f}  (target >= 0.85)")
    print(f"b/c = {rates['b'] / rates['c']:.3f}  (target > 1)")


if __name__ == "__main__":
    main()
