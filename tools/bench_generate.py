#!/usr/bin/env python
"""Generate-lane throughput on vLLM: the pipeline against offline vLLM and a one-shard-at-a-time worker.

The same prompts, with the same per-request seeds, three ways, doing the same work:

  (a) offline: one `LLM.generate` over all prompts at once, the upper bound;
  (b) pipeline: a real `dflash-queue worker generate` (vLLM engine, `--inflight` tasks at once) fed through
      Redis; timed from the start of enqueue until every shard is generated (extraction is not run);
  (c) naive: the same worker and queue with one task at a time, so each shard waits for its slowest reply.

The quality gate is off in the benchmark's config (every check "off"), so the queued runs generate each reply
once and keep it, as (a) does; (a) renders the prompts from the samples as the producer staged them for (b) (the
thinking policy applied). The bench reads every completions shard back and exits with an error unless (b) and
(c) hold the replies of (a), token for token.

With `--engine server` it measures the inference-server engine instead, against one `vllm serve` process of the
same model (started by the bench), in one run:

  (d) direct: a plain aiohttp client sending every prompt's ids straight to the server's /v1/completions, with
      `--requests-in-flight` requests outstanding at once;
  (e) lane: a real `dflash-queue worker generate` on the server engine (`generate.server.requests_in_flight` the
      same, `--inflight` tasks), fed through Redis, timed from enqueue until every shard is generated.

Both send the same prompts with the same per-request seeds and must store the same replies, token for token; it
prints tokens/s of each and e/d (target >= 0.95).

Reply lengths are heavy-tailed like thinking output (median ~35, mean ~165, p99 at the cap): the benchmark's model
(`build_long_tail_model`) ends a reply at temperature 1 with probability ~2% per token, or, with a smaller chance
per token, starts repeating one token and then runs to the cap. Engines are started before timing. Prints output
tokens/s for each and the ratios b/a (target >= 0.9) and b/c (> 1).

    .venv/bin/python tools/bench_generate.py [--samples 1024] [--shard-size 64] [--inflight 3]
    .venv/bin/python tools/bench_generate.py --engine server [--requests-in-flight 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tools"))

from bench_pipeline import make_dataset  # noqa: E402

from dflash_queue.broker.redis_server import RedisServer  # noqa: E402
from dflash_queue.config import Config, load_config  # noqa: E402
from dflash_queue.data.chat_template import ChatFormatter  # noqa: E402
from dflash_queue.data.readers import read_dataset  # noqa: E402
from dflash_queue.data.samples import Sample  # noqa: E402
from dflash_queue.engines.base import GenerationRequest  # noqa: E402
from dflash_queue.engines.vllm.generate import engine_args, request_seed, sampling_kwargs  # noqa: E402
from dflash_queue.engines.vllm.runtime import prepare_environment  # noqa: E402
from dflash_queue.lanes.turns import split_turns  # noqa: E402
from dflash_queue.producer import Producer  # noqa: E402
from dflash_queue.queue.app import configure_app  # noqa: E402
from dflash_queue.queue.launcher import WorkerProcess  # noqa: E402
from dflash_queue.runstate.ledger import GENERATED, Ledger  # noqa: E402
from dflash_queue.shards.completions import decode_completions  # noqa: E402
from dflash_queue.shards.keys import completions_key, prompts_key  # noqa: E402
from dflash_queue.shards.prompts import decode_prompts  # noqa: E402
from dflash_queue.storage import open_storage  # noqa: E402
from dfq_testing.configs import tiny_config_tables, tiny_vllm_overrides, write_config  # noqa: E402
from dfq_testing.polling import wait_for_states  # noqa: E402
from dfq_testing.servers import VllmServer  # noqa: E402
from dfq_testing.tiny_model import build_tiny_model  # noqa: E402

LONG_TAIL_VERSION = 1


def build_long_tail_model(
    out_dir: Path, *, eos_stop_probability: float = 0.02, loop_probability: float = 0.007, seed: int = 0
) -> Path:
    """The tiny model (`build_tiny_model`, into `{out_dir}-base`) with reply lengths heavy-tailed like thinking
    output: at temperature 1 a reply ends with probability `eos_stop_probability` per token, or, with about
    `loop_probability` per token, starts repeating one token (" lo"), which it then practically never leaves or
    ends: such replies run to the token cap.

    How: that token's embedding becomes a long vector along a direction `u` of its own, so a state whose input
    is that token is dominated by `u`; its output row is the end-of-sequence row (whose probability is nearly
    the same in every state) plus a shift along the states' common direction, solved so that its mean
    probability over sampled states is `loop_probability`, plus `3 u`, which makes it win by a wide margin
    in its own state. Built once; reused while its parameters match."""
    params = {
        "version": LONG_TAIL_VERSION,
        "eos_stop_probability": eos_stop_probability,
        "loop_probability": loop_probability,
        "seed": seed,
    }
    marker = out_dir / "long_tail.json"
    if marker.is_file() and json.loads(marker.read_text()) == params:
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from dfq_testing.tiny_model import TINY_CORPUS

    base = build_tiny_model(
        out_dir.with_name(out_dir.name + "-base"), eos_stop_probability=eos_stop_probability, seed=seed
    )
    tokenizer = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    specials = [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>", "<|im_start|>")]
    eos, loop_token = specials[0], tokenizer.encode(" loop", add_special_tokens=False)[0]
    corpus = tokenizer.encode(TINY_CORPUS, add_special_tokens=False)
    head = tokenizer.encode("<|im_start|>user\n", add_special_tokens=False)
    tail = tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    prompts = torch.tensor([head + corpus[i * 40 : i * 40 + 24] + tail for i in range(32)])
    generator = torch.Generator().manual_seed(seed)

    def step(ids, cache):
        out = model.model(input_ids=ids, past_key_values=cache, use_cache=True)
        return out.last_hidden_state[:, -1], out.past_key_values

    with torch.no_grad():
        # States of sampled replies (never ending, never looping) at temperature 1.
        hidden, cache = step(prompts, None)
        states = []
        for _ in range(128):
            logits = model.lm_head(hidden).double()
            logits[:, [*specials, loop_token]] = float("-inf")
            states.append(hidden.double())
            hidden, cache = step(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator), cache)
        states = torch.cat(states)
        common = states.mean(0) / states.mean(0).norm()
        u = torch.randn(states.shape[1], generator=generator, dtype=torch.float64)
        u -= (u @ common) * common
        u /= u.norm()
        embeddings = model.model.embed_tokens.weight
        embeddings[loop_token] = (10 * embeddings.norm(dim=1).mean() * u).to(embeddings.dtype)
        weight = model.lm_head.weight.double()

        def loop_row(shift: float):
            return weight[eos] + shift * common + 3.0 * u

        def mean_probability(shift: float) -> float:
            candidate = weight.clone()
            candidate[loop_token] = loop_row(shift)
            return float(torch.softmax(states @ candidate.T, -1)[:, loop_token].mean())

        low, high = -64.0, 64.0
        for _ in range(60):
            mid = (low + high) / 2
            low, high = (mid, high) if mean_probability(mid) < loop_probability else (low, mid)
        model.lm_head.weight[loop_token] = loop_row((low + high) / 2).to(weight.dtype)

    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp)
    model.save_pretrained(tmp, safe_serialization=True)
    (tmp / marker.name).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    return out_dir


# Every check of the quality gate off: no retries, no drops; each prompt's reply is generated once and kept.
GATE_OFF = {
    "on_empty": "off",
    "on_stub": "off",
    "on_short": "off",
    "on_truncated": "off",
    "on_unclosed_thinking": "off",
    "on_repetition": "off",
}


def stored_replies(config: Config, shard_ids: list[str]) -> dict[str, list[int]]:
    """Completion token ids per sample id, read back from the run's completions shards."""
    storage = open_storage(config.storage.url)
    return {
        record.id: record.completion_ids
        for shard_id in shard_ids
        for record in decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)
    }


def staged_samples(config: Config, shard_ids: list[str]) -> list[Sample]:
    """The samples as the producer staged them (thinking policy applied): what the workers generated from."""
    storage = open_storage(config.storage.url)
    return [
        sample
        for shard_id in shard_ids
        for sample in decode_prompts(storage.read_bytes(prompts_key(shard_id)), what=shard_id)
    ]


def through_queue(
    config: Config, dataset: Path, concurrency: int, log: Path
) -> tuple[dict[str, list[int]], float, list[Sample]]:
    """(replies by sample id, seconds, staged samples) from enqueue until every shard is generated, with a ready
    vLLM worker."""
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
        ledger = Ledger.from_url(config.broker.connection_url(), config.run.name)
        started = time.perf_counter()
        report = Producer(config, ledger).enqueue([dataset])
        wait_for_states(ledger, report.shard_ids, {GENERATED}, timeout=7200, workers=[worker], poll_s=0.01)
        elapsed = time.perf_counter() - started
        return stored_replies(config, report.shard_ids), elapsed, staged_samples(config, report.shard_ids)
    finally:
        worker.stop(timeout=120)


def offline(config: Config, samples: list[Sample]) -> tuple[dict[str, list[int]], float]:
    """(replies by sample id, seconds) of one LLM.generate over every prompt, engine started before timing."""
    from transformers import AutoTokenizer
    from vllm import LLM, SamplingParams, TokensPrompt

    prepare_environment(config.generate.vllm)
    formatter = ChatFormatter(AutoTokenizer.from_pretrained(config.model.tokenizer_path))
    prompts = [
        TokensPrompt(
            prompt_token_ids=formatter.prompt_ids(split_turns(s)[0], enable_thinking=s.thinking, tools=s.tools)
        )
        for s in samples
    ]
    params = [
        SamplingParams(**sampling_kwargs(config.generate.sampling, GenerationRequest(s.id, p["prompt_token_ids"])))
        for s, p in zip(samples, prompts)
    ]
    llm = LLM(**{**engine_args(config.model, config.generate.vllm), "disable_log_stats": True})
    try:
        started = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - started
    finally:
        llm.llm_engine.engine_core.shutdown()
    return {s.id: list(o.outputs[0].token_ids) for s, o in zip(samples, outputs)}, elapsed


def direct_client(
    server_url: str, model: str, config: Config, samples: list[Sample], requests_in_flight: int
) -> tuple[dict[str, list[int]], float]:
    """(replies by sample id, seconds) of a plain aiohttp client sending every prompt to the server at once,
    `requests_in_flight` outstanding; the same request bodies the server engine sends (same seeds)."""
    import aiohttp
    from transformers import AutoTokenizer

    from dflash_queue.engines.server.protocols import GenerationParams, VllmCompletions

    formatter = ChatFormatter(AutoTokenizer.from_pretrained(config.model.tokenizer_path))
    sampling = config.generate.sampling
    bodies = {
        s.id: VllmCompletions().generation_body(
            model,
            sampling,
            GenerationParams(
                formatter.prompt_ids(split_turns(s)[0], enable_thinking=s.thinking, tools=s.tools),
                sampling.max_tokens,
                request_seed(sampling.seed, s.id),
                f"direct-{s.id}",
            ),
        )
        for s in samples
    }

    async def run() -> dict[str, list[int]]:
        slots = asyncio.Semaphore(requests_in_flight)
        connector = aiohttp.TCPConnector(limit=requests_in_flight)
        async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as session:

            async def one(sample_id: str, body: dict) -> tuple[str, list[int]]:
                async with slots, session.post(server_url + "/v1/completions", json=body) as answer:
                    answer.raise_for_status()
                    return sample_id, (await answer.json())["choices"][0]["token_ids"]

            return dict(await asyncio.gather(*(one(i, b) for i, b in bodies.items())))

    started = time.perf_counter()
    replies = asyncio.run(run())
    return replies, time.perf_counter() - started


def bench_server(args: argparse.Namespace, model: Path, tmp: Path, redis_url: str, dataset: Path) -> None:
    """(d) a plain client and (e) the lane's server engine against one `vllm serve` of `model`, in `--rounds`
    rounds that alternate which goes first (a busy machine's load drifts); the ratio is of the summed rates."""
    # Prefix caching off: every run prefills every prompt, however many ran before it.
    server = VllmServer(model, tmp / "server.log", served_name="bench", max_model_len=4096,
                        max_num_seqs=args.max_num_seqs, extra_args=("--no-enable-prefix-caching",)).start()

    def lane_config(name: str) -> Config:
        tables = tiny_config_tables(model, tmp / name / "storage", redis_url, tmp / name / "state")
        overrides = {
            "run": {"name": name, "state_dir": str(tmp / name / "state")},
            "dataset": {"shard_size": args.shard_size, "thinking": "always", "max_model_len": 4096},
            "generate": {"engine": "server"},
            "generate.server": {"urls": [server.url], "model": "bench", "requests_in_flight": args.requests_in_flight,
                                "inflight_tasks": args.inflight},
            "generate.sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": args.max_tokens},
            "quality": GATE_OFF,
        }
        return load_config(write_config(tmp / f"{name}.toml", tables, **overrides))

    times: dict[str, list[float]] = {"d": [], "e": []}
    replies: dict[str, list[dict[str, list[int]]]] = {"d": [], "e": []}
    try:
        # The dataset's samples (thinking on, as the policy "always" stages them; checked by the replies agreeing
        # with the lane's), and a warm-up of the server, before anything is timed.
        staged = [s for s in read_dataset([dataset], max_record_bytes=1 << 20) if isinstance(s, Sample)]
        direct_client(server.url, "bench", lane_config("warmup"), staged[:64], args.requests_in_flight)
        for round_index in range(args.rounds):
            for run in ("de" if round_index % 2 == 0 else "ed"):
                if run == "d":
                    got, seconds = direct_client(server.url, "bench", lane_config("direct"), staged,
                                                 args.requests_in_flight)
                else:
                    got, seconds, staged = through_queue(
                        lane_config(f"lane-{round_index}"), dataset, args.inflight, tmp / f"e-{round_index}.log"
                    )
                times[run].append(seconds)
                replies[run].append(got)
    finally:
        server.stop()
    reference = replies["d"][0]
    tokens = sum(len(reply) for reply in reference.values())
    lengths = sorted(len(reply) for reply in reference.values())
    print(
        f"job: {len(reference)} prompts in shards of {args.shard_size}; one vllm serve, max_num_seqs "
        f"{args.max_num_seqs}; {args.requests_in_flight} requests in flight; reply lengths mean "
        f"{statistics.mean(lengths):.0f}, p50 {lengths[len(lengths) // 2]}, max {lengths[-1]} tokens; "
        f"{tokens} output tokens per run"
    )
    for round_index in range(args.rounds):
        d, e = times["d"][round_index], times["e"][round_index]
        first = "d" if round_index % 2 == 0 else "e"
        print(f"round {round_index + 1} ({first} first): (d) {d:7.2f} s {tokens / d:7.0f} tok/s   "
              f"(e) {e:7.2f} s {tokens / e:7.0f} tok/s   e/d = {d / e:.3f}")
    rates = {run: len(seconds) * tokens / sum(seconds) for run, seconds in times.items()}
    print(f"(d) plain client, straight to the server:            {rates['d']:8.0f} tok/s")
    print(f"(e) lane, server-engine worker, {args.inflight} tasks in flight:  {rates['e']:8.0f} tok/s")
    print("    (e): from enqueue to every shard generated, through Redis; extraction not run")
    print(f"e/d = {rates['e'] / rates['d']:.3f}  (target >= 0.95)")
    for run, runs in replies.items():
        for got in runs:
            differ = [i for i in reference if got.get(i) != reference[i]]
            if differ or len(got) != len(reference):
                raise SystemExit(
                    f"a run of ({run}) did other work: {len(differ)} of {len(reference)} replies differ "
                    f"({len(got)} stored); the ratio would not compare like with like"
                )
    print("same replies in every run, token for token")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument("--engine", choices=("vllm", "server"), default="vllm",
                        help="vllm: (a), (b), (c); server: (d), (e) against one vllm serve")
    parser.add_argument("--inflight", type=int, default=3, help="tasks in flight for (b) and (e)")
    parser.add_argument("--requests-in-flight", type=int, default=64, help="requests outstanding for (d) and (e)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (d) and (e), alternating which goes first")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=768, help="cap on reply length (rarely reached)")
    parser.add_argument("--model", type=Path, default=REPO / ".cache" / "tiny-qwen3-long-tail")
    parser.add_argument("--eos-stop-probability", type=float, default=0.02, help="per-token chance a reply ends")
    parser.add_argument(
        "--loop-probability", type=float, default=0.007, help="per-token chance a reply starts to loop (to the cap)"
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")

    model = build_long_tail_model(
        args.model, eos_stop_probability=args.eos_stop_probability, loop_probability=args.loop_probability
    )
    with tempfile.TemporaryDirectory(prefix="dfq-bench-gen-") as tmp_name, RedisServer(Path(tmp_name) / "redis") as redis:
        tmp = Path(tmp_name)
        dataset = make_dataset(args.samples, tmp / "prompts.jsonl")
        if args.engine == "server":
            bench_server(args, model, tmp, redis.url, dataset)
            return
        samples = [s for s in read_dataset([dataset], max_record_bytes=1 << 20) if isinstance(s, Sample)]

        def config_for(name: str) -> Config:
            tables = tiny_config_tables(model, tmp / name / "storage", redis.url, tmp / name / "state")
            overrides = {
                **tiny_vllm_overrides(max_num_seqs=args.max_num_seqs, inflight_tasks=args.inflight),
                "run": {"name": name, "state_dir": str(tmp / name / "state")},
                "dataset": {"shard_size": args.shard_size, "thinking": "always"},
                "generate.sampling": {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_tokens": args.max_tokens},
                "quality": GATE_OFF,
            }
            return load_config(write_config(tmp / f"{name}.toml", tables, **overrides))

        pipeline_replies, pipeline_s, staged = through_queue(
            config_for("pipeline"), dataset, args.inflight, tmp / "b.log"
        )
        naive_replies, naive_s, _ = through_queue(config_for("naive"), dataset, 1, tmp / "c.log")
        # The prompts exactly as the workers had them (the producer applies the thinking policy, for one).
        offline_replies, offline_s = offline(config_for("offline"), staged)

    lengths = [len(reply) for reply in offline_replies.values()]
    offline_tokens = sum(lengths)
    pipeline_tokens = sum(len(reply) for reply in pipeline_replies.values())
    naive_tokens = sum(len(reply) for reply in naive_replies.values())
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
    print(f"output tokens: a {offline_tokens}, b {pipeline_tokens}, c {naive_tokens}")
    print(f"(a) offline LLM.generate, all prompts at once:        {offline_s:7.2f} s  {rates['a']:8.0f} tok/s")
    print(f"(b) pipeline, vLLM worker, {args.inflight} tasks in flight:      {pipeline_s:7.2f} s  {rates['b']:8.0f} tok/s")
    print(f"(c) naive worker, one shard at a time:                {naive_s:7.2f} s  {rates['c']:8.0f} tok/s")
    print("    (b) and (c): from enqueue to every shard generated, through Redis; extraction not run")
    print(f"b/a = {rates['b'] / rates['a']:.3f}  (target >= 0.9)")
    print(f"b/c = {rates['b'] / rates['c']:.3f}  (target > 1)")
    for name, replies in (("b", pipeline_replies), ("c", naive_replies)):
        differ = [i for i in offline_replies if replies.get(i) != offline_replies[i]]
        if differ or len(replies) != len(offline_replies):
            raise SystemExit(
                f"({name}) did other work than (a): {len(differ)} of {len(offline_replies)} replies differ "
                f"({len(replies)} stored); the ratios would not compare like with like"
            )
    print("same replies in all three, token for token")


if __name__ == "__main__":
    main()
