#!/usr/bin/env python
"""The reference audit's cost, measured side by side in one run, and the load-time reference check's time.

  extract lane   the same completions shards extracted by a real `dflash-queue worker extract` (its engine loaded
                 before timing, `taskset` to one core), with the audit off and on (`audit.every_shards`,
                 `audit.samples_per_shard` as given; a real `dflash-queue worker audit` on a core of its own), in
                 rounds that alternate which goes first, each round on fresh shards. Timed from sending the extract
                 tasks until the ledger shows every shard done; the ratio on/off of the lane's tokens/s (target: at
                 least 0.98 when the audit has its own core: what the lane pays is a Redis script and a message per
                 shard). Torch runs one thread in every worker (OMP_NUM_THREADS=1): on a shared machine more threads
                 than free cores spin.
  audit          its own rate: the tokens it recomputed over its busy time (both passes of the checkpoint's own
                 forward, float32 and the engine's dtype, streamed one decoder layer at a time, and the comparison).
  load check     the streamed forward's rate here (parameters x tokens per second, float32 and the engine's dtype, and
                 its layer loads' bytes per second) over a probe of `--probe-tokens` (1,024: the load check's probe on
                 host cores beside a GPU engine), and that probe's time extrapolated to `--target` (a config directory,
                 default examples/qwen3.6-27b-class, the seed target: 27B parameters, 64 layers) from its parameter count
                 and bytes, at the rates measured here.

    .venv/bin/python tools/bench_audit.py                       # SmolLM2-135M-Instruct (trained), 8 shards x 8
    .venv/bin/python tools/bench_audit.py --quick               # 2 shards, 1 round
    .venv/bin/python tools/bench_audit.py --model DIR --dtype bfloat16 --shards 16 --rounds 3 --json FILE
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from datetime import date
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
SEED_TARGET = REPO / "examples" / "qwen3.6-27b-class"


def completions(model: Path, shards: int, shard_size: int, max_tokens: int, tag: str) -> list[list[Any]]:
    """Shards of real chat sequences through the model's own template: the sample job's questions and answers."""
    from transformers import AutoTokenizer

    from dflash_queue.shards.completions import CompletionRecord

    tokenizer = AutoTokenizer.from_pretrained(model)
    rows = [json.loads(line)["conversations"] for line in SAMPLE.read_text(encoding="utf-8").splitlines()]
    pairs = [(t[0]["value"], t[1]["value"]) for t in rows if len(t) >= 2 and t[0]["from"] == "human"]
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = []
    for shard in range(shards):
        records = []
        for i in range(shard_size):
            question, answer = pairs[(shard * shard_size + i) % len(pairs)]
            prompt = tokenizer.apply_chat_template([{"role": "user", "content": f"{question} ({shard}.{i})"}],
                                                   add_generation_prompt=True, tokenize=True)
            prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
            completion = tokenizer.encode(answer, add_special_tokens=False)[: max_tokens - 1] + [end]
            records.append(CompletionRecord(id=f"{tag}-{shard:03d}-{i}", prompt_ids=prompt, completion_ids=completion,
                                            finish_reason="stop", thinking=False, text=""))
        out.append(records)
    return out


def pinned(core: int) -> tuple[str, ...]:
    """`taskset` to one core when there is one for it."""
    if not shutil.which("taskset") or (os.cpu_count() or 1) <= core:
        return ()
    return ("taskset", "-c", str(core))


def run_round(args, work: Path, broker_url: str, number: int, audit_on: bool, shards: list[list[Any]]) -> dict:
    from dflash_queue.config import load_config
    from dflash_queue.queue.app import configure_app
    from dflash_queue.queue.launcher import WorkerProcess
    from dflash_queue.queue.messages import messages_in
    from dflash_queue.queue.tasks import send_to_lane
    from dflash_queue.runstate.ledger import DONE, FAILED, GENERATED, Ledger
    from dflash_queue.shards.completions import encode_completions
    from dflash_queue.shards.keys import completions_key
    from dflash_queue.storage import LocalStorage
    from dfq_testing.configs import tiny_config_tables, write_config

    mode = "on" if audit_on else "off"
    root = work / f"round-{number}-{mode}"
    root.mkdir(parents=True, exist_ok=True)
    tables = tiny_config_tables(args.model, root / "storage", broker_url, root / "state")
    config_path = write_config(
        root / "config.toml", tables,
        run={"name": f"bench-audit-{number}-{mode}", "state_dir": str(root / "state")},
        model={"name": "bench", "dtype": args.dtype},
        dataset={"shard_size": args.shard_size, "thinking": "never"},
        extract={"num_draft_layers": 5, "last_layer_state": True, "canary_samples": 1},
        audit={"enabled": audit_on, "every_shards": args.every_shards, "samples_per_shard": args.samples_per_shard,
               "every_minutes": 0.0},
    )
    config = load_config(config_path)
    storage = LocalStorage(config.storage.url)
    ledger = Ledger.from_url(broker_url, config.run.name)
    ids = []
    for index, records in enumerate(shards):
        shard_id = f"r{number}{mode}-{index:03d}"
        storage.write_bytes(completions_key(shard_id), encode_completions(records))
        ledger.set_state(shard_id, GENERATED, num_samples=len(records))
        ids.append((shard_id, len(records)))
    app = configure_app(config)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DFQ_BROKER_URL": broker_url}
    lanes = [("extract", 0)] + ([("audit", 1)] if audit_on else [])
    workers = [
        WorkerProcess(lane, config_path, env, root / f"{lane}.log", hostname=f"{lane}-bench-{number}-{mode}@bench",
                      prefix=pinned(core))
        for lane, core in lanes
    ]
    try:
        for worker in workers:
            worker.wait_ready(app, timeout=900)
        started = time.perf_counter()
        for shard_id, size in ids:
            send_to_lane("extract", shard_id, size, config.fingerprint())
        while True:
            states = ledger.states([s for s, _ in ids])
            if all(state in (DONE, FAILED) for state in states.values()):
                break
            time.sleep(0.05)
        extract_s = time.perf_counter() - started
        while audit_on and messages_in(ledger.client, "audit"):
            time.sleep(0.2)
        counters = ledger.counters()
    finally:
        for worker in workers:
            worker.terminate()
        for worker in workers:
            worker.stop(timeout=120)
    failed = [s for s, state in states.items() if state == FAILED]
    if failed:
        raise RuntimeError(f"round {number} ({mode}): shards failed: {failed}; see {root}")
    tokens = counters.get("extract_tokens", 0)
    return {
        "round": number, "audit": mode, "extract_s": extract_s, "extract_tokens": tokens,
        "extract_tokens_per_s": tokens / extract_s,
        "audit_shards": counters.get("audit_shards", 0), "audit_tokens": counters.get("audit_tokens", 0),
        "audit_busy_s": counters.get("audit_busy_ms", 0) / 1000, "audit_failed": counters.get("audit_failed", 0),
    }


def load_check(args) -> dict:
    """The streamed forward's rates over a probe, and the probe's time at the seed target's size."""
    import torch
    from transformers import AutoConfig

    from dflash_queue.engines.reference.check import reference_probe_lengths
    from dflash_queue.engines.reference.streamed import StreamedDecoder
    from dflash_queue.ops.model_size import count_parameters

    decoder = StreamedDecoder(str(args.model))
    text = decoder.layout.text_config
    layers_params = sum(count_parameters(text).active_layers)
    captured = [(0, "decoder_output"), (decoder.num_layers - 1, "last_layer"), (decoder.num_layers - 1, "final_norm")]
    lengths = reference_probe_lengths(args.probe_tokens, 4096)
    sequences = [[(7 * i + 3 * n) % 1000 + 10 for i in range(length)] for n, length in enumerate(lengths)]
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    decoder.run(sequences[:1], captured, torch.float32)  # warm-up: page cache, first-call costs
    passes = {}
    for name, pass_dtype in (("float32", torch.float32), (args.dtype, dtype)):
        run = decoder.run(sequences, captured, pass_dtype)
        bytes_loaded = decoder.layer_bytes(pass_dtype) * decoder.num_layers
        passes[name] = {
            "seconds": run.seconds, "load_seconds": run.load_seconds,
            "param_tokens_per_s": layers_params * run.tokens / max(run.seconds - run.load_seconds, 1e-9),
            "load_bytes_per_s": bytes_loaded / max(run.load_seconds, 1e-9),
        }
    target = AutoConfig.from_pretrained(args.target)
    target_text = target.get_text_config()
    target_params = sum(count_parameters(target_text).active_layers)
    target_bytes = sum(count_parameters(target_text).layers)
    estimate = {
        name: target_params * sum(lengths) / rates["param_tokens_per_s"]
        + target_bytes * (4 if name == "float32" else 2) / rates["load_bytes_per_s"]
        for name, rates in passes.items()
    }
    return {
        "model": str(args.model), "layers_params": layers_params, "probe_lengths": lengths, "threads": args.threads,
        "passes": passes, "probe_seconds": sum(p["seconds"] for p in passes.values()),
        "target": str(args.target), "target_layers": int(target_text.num_hidden_layers),
        "target_layers_params": target_params, "target_estimate_s": estimate,
        "target_probe_seconds": sum(estimate.values()),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", type=Path, default=None, help="checkpoint (default: SmolLM2-135M-Instruct, built)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--shards", type=int, default=8)
    parser.add_argument("--shard-size", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=160, help="completion tokens per sample at most")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of (off, on), alternating which goes first")
    parser.add_argument("--every-shards", type=int, default=8)
    parser.add_argument("--samples-per-shard", type=int, default=1)
    parser.add_argument("--probe-tokens", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the load-check measurement")
    parser.add_argument("--target", type=Path, default=SEED_TARGET)
    parser.add_argument("--quick", action="store_true", help="2 shards of 4, one round, a 256-token probe")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None, help="work directory (default: a temporary one)")
    args = parser.parse_args()
    if args.quick:
        args.shards, args.shard_size, args.rounds, args.probe_tokens, args.max_tokens = 2, 4, 1, 256, 48
    if args.model is None:
        from dfq_testing.trained_model import build_trained_model

        args.model = build_trained_model(REPO / ".cache" / "smollm2-135m-instruct")
    args.model = args.model.resolve()
    from dflash_queue.broker.redis_server import RedisServer

    work = args.out or Path(tempfile.mkdtemp(prefix="bench-audit-"))
    work.mkdir(parents=True, exist_ok=True)
    server = RedisServer(work / "redis", appendonly=False).start()
    results = []
    try:
        for number in range(args.rounds):
            order = [False, True] if number % 2 == 0 else [True, False]
            for audit_on in order:
                shards = completions(args.model, args.shards, args.shard_size, args.max_tokens,
                                     f"r{number}{'on' if audit_on else 'off'}")
                result = run_round(args, work, server.url, number, audit_on, shards)
                results.append(result)
                print(f"round {number} audit {result['audit']:>3}: {result['extract_tokens']} tokens in "
                      f"{result['extract_s']:.1f} s = {result['extract_tokens_per_s']:.0f} tokens/s"
                      + (f"; audited {result['audit_shards']} shard(s), {result['audit_tokens']} tokens in "
                         f"{result['audit_busy_s']:.1f} s busy" if audit_on else ""), flush=True)
    finally:
        server.stop()
    off = [r["extract_tokens_per_s"] for r in results if r["audit"] == "off"]
    on = [r["extract_tokens_per_s"] for r in results if r["audit"] == "on"]
    audited = [r for r in results if r["audit"] == "on"]
    audit_tokens = sum(r["audit_tokens"] for r in audited)
    audit_busy = sum(r["audit_busy_s"] for r in audited)
    check = load_check(args)
    report = {
        "date": date.today().isoformat(), "machine": os.uname().nodename, "cpus": os.cpu_count(),
        "model": str(args.model), "dtype": args.dtype, "shards": args.shards, "shard_size": args.shard_size,
        "every_shards": args.every_shards, "samples_per_shard": args.samples_per_shard, "rounds": results,
        "extract_ratio_on_off": statistics.median(on) / statistics.median(off),
        "audit_tokens_per_s": audit_tokens / audit_busy if audit_busy else None,
        "audit_failed": sum(r["audit_failed"] for r in audited), "load_check": check,
    }
    print(f"extract lane with the audit on / off: {report['extract_ratio_on_off']:.3f} of its tokens/s (median "
          f"{statistics.median(on):.0f} / {statistics.median(off):.0f}); the audit: "
          + (f"{report['audit_tokens_per_s']:.0f} tokens/s of its busy time ({audit_tokens} tokens), "
             f"{report['audit_failed']} failed" if audit_busy else "nothing audited"))
    passes = check["passes"]
    print(f"load check: a probe of {sum(check['probe_lengths'])} tokens ({'/'.join(map(str, check['probe_lengths']))}) "
          f"took {check['probe_seconds']:.1f} s here ({check['threads']} thread(s): "
          + "; ".join(f"{name} {p['param_tokens_per_s'] / 1e9:.1f} G parameter-tokens/s, layers loaded at "
                      f"{p['load_bytes_per_s'] / 1e9:.2f} GB/s" for name, p in passes.items())
          + f"); at {Path(check['target']).name} ({check['target_layers']} layers, "
          f"{check['target_layers_params'] / 1e9:.1f} B parameters a token goes through) the same probe would take "
          f"{check['target_probe_seconds'] / 60:.1f} min at these rates")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    if args.out is None:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
