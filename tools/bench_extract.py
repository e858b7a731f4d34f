#!/usr/bin/env python
"""Extract-lane throughput of the two engines, Transformers and vLLM, on the same shards and model, in one run.

The same completions shards (random token ids, prompt + completion lengths log-uniform in --min-len..--max-len)
are extracted by each engine into a store of its own. For each engine:

  tokens/s       the tokens of every measured shard over the wall time of `ExtractLane.run` over them, as a
                 worker runs its tasks (as many threads as the lane's default task slots: one computing on the
                 Transformers model and `extract.vllm.inflight_tasks` on vLLM, plus the uploader's pending ones;
                 local storage). Engine load and one 2-sample warm-up shard are not timed;
  peak memory    the largest RSS of the engine's whole process tree (its process and every descendant: vLLM's
                 engine runs in child processes), sampled every 50 ms from outside while it runs, load included;
  canary         --canary-measured samples of at most the median length rerun alone after the timed part
                 (`reference_states`, as the lane's canary does: through the model's own attention, or as a batch
                 of one through the vLLM engine; each sample's best of 3 passes), their time per token over the engine's
                 batched time per token, and the share of a shard's extract time `extract.canary_samples` such
                 samples cost (a canary runs E[len | len <= median] / mean(len) of the average sample's tokens).

Each engine runs in a subprocess of its own (this script with --child), so that neither engine's memory stays
in the other's process; rounds alternate which engine goes first and the ratio vllm/transformers is that of the
median tokens/s. The first round's shards of both engines are read back and compared sample by sample
(`compare_states`: relative error per layer; the worst over all samples is printed; float32 on the CPU gives
~1e-6).

Beside tokens/s, each engine's MFU: the useful FLOPs of the measured shards (`extraction_flops`, from the
model's shapes: 2 x the parameters a token goes through in the layers the engine runs, plus attention's
query-key pairs and linear attention's state updates) over the wall time, against --peak-tflops (790: one H200,
bfloat16). The Transformers engine is also timed alone on the first shard (`extract`, no lane around it:
compute and the copy to the host), and the kernels its model's classes bound are named (Gated DeltaNet's from
flash-linear-attention, or Transformers' PyTorch fallback). With --reference-samples N, N of the Transformers
engine's stored samples of the first round (spread over the lengths) are compared with the checkpoint's own
class (`dfq_testing.references`) run on each sample alone in --dtype, with Transformers' own PyTorch kernels
(flash-linear-attention and causal-conv1d kept out), in a process of its own: relative error per layer, over the
sample and at its worst token.

    .venv/bin/python tools/bench_extract.py                      # tiny Qwen3 family on the CPU
    .venv/bin/python tools/bench_extract.py --quick              # 2 shards of 8 samples, 16-256 tokens
    python tools/bench_extract.py --model DIR --device cuda --dtype bfloat16 [--tensor-parallel-size N]
    python tools/bench_extract.py --model DIR --engines transformers --reference-samples 4 --json-file FILE
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

ENGINES = ("transformers", "vllm")
GIB = 2**30
WARMUP = "warmup"
CANARY_REPEATS = 3
SAMPLE_INTERVAL_S = 0.05
# Processes of the tree are listed again this often; their RSS is read at every sample.
LIST_INTERVAL_S = 0.5


# -----------------------------------------------------------------------------------------------------------------
# Inputs


def resolve_model(args: argparse.Namespace) -> Path:
    if args.model:
        return Path(args.model).resolve()
    from dfq_testing.families import build_family
    from dfq_testing.tiny_model import build_tiny_model

    cache = REPO / ".cache"
    tokenizer = build_tiny_model(cache / "tiny-qwen3")
    return build_family(args.family, cache / f"family-{args.family}", tokenizer)


def write_inputs(root: Path, shard_ids: list[str], args: argparse.Namespace, vocab: int) -> dict[str, list[int]]:
    """Completions shards of random sequences: lengths log-uniform, each split at random into prompt and completion.
    Each shard's sequence lengths."""
    from dflash_queue.shards.completions import CompletionRecord, encode_completions
    from dflash_queue.shards.keys import completions_key
    from dflash_queue.storage import open_storage

    storage = open_storage(str(root))
    rng = random.Random(args.seed)
    low, high = math.log(args.min_len), math.log(args.max_len)
    sizes = [(WARMUP, 2)] + [(shard, args.shard_size) for shard in shard_ids]
    lengths: dict[str, list[int]] = {}
    for shard, count in sizes:
        records = []
        for i in range(count):
            length = min(args.max_len, max(args.min_len, round(math.exp(rng.uniform(low, high)))))
            if shard == WARMUP:
                length = args.min_len
            ids = [rng.randrange(vocab) for _ in range(length)]
            split = rng.randint(1, length - 1)
            records.append(CompletionRecord(f"{shard}-{i}", ids[:split], ids[split:], "stop", thinking=False, text=""))
        storage.write_bytes(completions_key(shard), encode_completions(records))
        lengths[shard] = [len(r.prompt_ids) + len(r.completion_ids) for r in records]  # as the engine sees them
    return lengths


def config_path(args: argparse.Namespace, model: Path, engine: str, store: Path, state: Path) -> Path:
    from dfq_testing.configs import tiny_config_tables, write_config

    vllm: dict[str, Any] = {
        "dtype": args.dtype, "tensor_parallel_size": args.tensor_parallel_size, "max_model_len": args.max_model_len,
        "max_num_batched_tokens": args.max_num_batched_tokens or args.token_budget,
        "kv_cache_memory_gib": args.kv_cache_gib,
        "enforce_eager": args.enforce_eager, "log_stats_interval_s": 0, "shutdown_timeout_s": 60,
    }
    extract: dict[str, Any] = {"engine": engine, "hidden_dtype": args.hidden_dtype, "token_budget": args.token_budget,
                               "canary_samples": args.canary_samples}
    if args.layer_ids:
        extract["layer_ids"] = args.layer_ids
    else:
        extract["num_draft_layers"] = args.layers
    tables = tiny_config_tables(model, store, "redis://127.0.0.1:1/0", state)
    return write_config(
        state.parent / f"{state.name}.toml",
        tables,
        model={"path": str(model), "name": model.name, "dtype": args.dtype, "device": args.device},
        dataset={"shard_size": args.shard_size},
        extract=extract,
        **{"extract.vllm": vllm},
    )


# -----------------------------------------------------------------------------------------------------------------
# One engine, in a process of its own


def run_child(args: argparse.Namespace) -> int:
    import torch

    from dflash_queue.config import load_config
    from dflash_queue.engines.base import ExtractionRequest
    from dflash_queue.engines.decoder import decoder_layers
    from dflash_queue.lanes.extract import ExtractLane, build_extractor, extract_lane_settings
    from dflash_queue.lanes.registry import EXTRACT
    from dflash_queue.shards.completions import decode_completions
    from dflash_queue.shards.keys import completions_key
    from dflash_queue.storage import open_storage

    engine, work = args.child, Path(args.work)
    config = load_config(Path(args.config))
    shard_ids = json.loads((work / "shards.json").read_text())
    storage = open_storage(config.storage)
    started = time.perf_counter()
    extractor = build_extractor(config)
    load_s = time.perf_counter() - started
    model = getattr(extractor, "model", None) if engine == "transformers" else None
    lane = ExtractLane(extract_lane_settings(config), extractor, storage)
    cuda = config.model.device == "cuda"
    try:
        lane.run(WARMUP)
        slots = EXTRACT.default_slots(config)
        start = time.perf_counter()
        with ThreadPoolExecutor(slots, thread_name_prefix="task") as pool:
            summaries = list(pool.map(lane.run, shard_ids))
        seconds = time.perf_counter() - start
        tokens = sum(s.num_tokens for s in summaries)

        # The canary alone: samples no longer than the median, as the lane picks them.
        records = [r for shard in shard_ids for r in decode_completions(
            storage.read_bytes(completions_key(shard)), what=shard)]
        lengths = sorted(len(r.input_ids) for r in records)
        median = lengths[(len(lengths) - 1) // 2]
        short = [r for r in records if len(r.input_ids) <= median]
        chosen = [ExtractionRequest(r.id, r.input_ids) for r in short[: args.canary_measured]]

        def alone(request: ExtractionRequest) -> float:
            started = time.perf_counter()
            extractor.reference_states(request, on_device=True)
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - started

        # Each sample's best of CANARY_REPEATS passes over them all: a stall of a busy host is not the canary's cost.
        passes = [[alone(request) for request in chosen] for _ in range(CANARY_REPEATS)]
        canary_s = sum(min(times) for times in zip(*passes))
        canary_tokens = sum(len(r.input_ids) for r in chosen)
        short_mean = sum(len(r.input_ids) for r in short) / len(short)

        engine_alone = None
        if model is not None:  # the Transformers engine's own work on the first shard: compute, copy to host
            first = [ExtractionRequest(r.id, r.input_ids) for r in decode_completions(
                storage.read_bytes(completions_key(shard_ids[0])), what=shard_ids[0])]
            if cuda:
                torch.cuda.synchronize()
            started = time.perf_counter()
            extractor.extract(first)
            if cuda:
                torch.cuda.synchronize()
            engine_alone = {"shard": shard_ids[0], "tokens": sum(len(r.input_ids) for r in first),
                            "seconds": time.perf_counter() - started}
        result = {
            "engine": engine, "mode": extractor.mode, "load_s": load_s, "task_slots": slots,
            "layers_run": len(decoder_layers(model)) if model is not None else None,
            "kernels": kernel_paths(model) if model is not None else {}, "engine_alone": engine_alone,
            "shards": len(summaries), "samples": sum(s.num_samples for s in summaries), "tokens": tokens,
            "seconds": seconds,
            "canary": {
                "samples": len(chosen), "tokens": canary_tokens, "seconds": canary_s,
                "alone_over_batched": (canary_s / canary_tokens) / (seconds / tokens),
                "length_ratio": short_mean / (sum(lengths) / len(lengths)),
            },
        }
    finally:
        lane.close()
    (work / f"result-{args.tag}.json").write_text(json.dumps(result))
    return 0


def kernel_paths(model: Any) -> dict[str, str]:
    """The implementation each of the model's Transformers modules bound for its optional kernels (Gated
    DeltaNet's `chunk_gated_delta_rule`, `causal_conv1d_fn`, ...): the package's when it imported at load, else
    Transformers' PyTorch fallback. Read from the wrappers Transformers' `use_kernel_func_from_hub_with_fallback`
    made, which hold the chosen function as `implementation`."""
    found: dict[str, str] = {}
    for name in sorted({type(module).__module__ for module in model.modules()}):
        found.update(module_kernels(sys.modules[name]))
    return found


def module_kernels(namespace: Any) -> dict[str, str]:
    """Of one module: each kernel wrapper's name -> the function it calls ("module.name")."""
    found = {}
    for attribute, value in vars(namespace).items():
        code, closure = getattr(value, "__code__", None), getattr(value, "__closure__", None)
        if code is None or not closure:
            continue
        cells = dict(zip(code.co_freevars, closure))
        if "implementation" in cells and "is_new_implementation" in cells:
            chosen = cells["implementation"].cell_contents
            found[attribute] = f"{chosen.__module__}.{chosen.__qualname__}"
    return found


# The reference runs Transformers' own PyTorch code: the engine's kernels are among what it checks.
OPTIONAL_KERNELS = ("fla", "causal_conv1d")


class _KeepOut:
    """A meta-path finder that makes the optional kernel packages fail to import, as if absent."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name.split(".")[0] in OPTIONAL_KERNELS:
            raise ModuleNotFoundError(f"No module named {name!r} (kept out of the reference)", name=name)
        return None


def run_reference(args: argparse.Namespace) -> int:
    """The checkpoint's own class on --reference-samples stored samples alone, against what the store holds."""
    sys.meta_path.insert(0, _KeepOut())
    import torch

    from dflash_queue.shards.keys import shard_key
    from dflash_queue.shards.training import TrainingShard
    from dfq_testing.references import reference_model, reference_states

    work, store = Path(args.work), Path(args.store)
    shard_ids = json.loads((work / "shards.json").read_text())
    shards = {shard: TrainingShard(store / shard_key(shard)) for shard in shard_ids}
    by_length = sorted((int(shards[s].offsets[i + 1] - shards[s].offsets[i]), s, i)
                       for s in shard_ids for i in range(len(shards[s])))
    count = min(args.reference_samples, len(by_length))
    # Spread over the lengths, the longest included.
    picked = [by_length[round(j * (len(by_length) - 1) / max(1, count - 1))] for j in range(count)]
    started = time.perf_counter()
    model = reference_model(args.model_path, "sdpa", getattr(torch, args.dtype)).to(args.device)
    load_s = time.perf_counter() - started
    samples = []
    for length, shard, index in picked:
        meta = shards[shard].metadata
        captured = list(zip(json.loads(meta["layer_ids"]), json.loads(meta["layer_states"])))
        sample = shards[shard][index]
        want = reference_states(model, sample.input_ids.to(args.device), captured).float().cpu()
        got = sample.hidden_states.float()
        if got.shape != want.shape:
            raise SystemExit(f"sample {sample.id}: stored states {tuple(got.shape)}, reference {tuple(want.shape)}")
        difference = torch.linalg.vector_norm(got - want, dim=-1)  # [T, K]
        scale = torch.linalg.vector_norm(want, dim=-1)
        whole = difference.square().sum(0).sqrt() / scale.square().sum(0).sqrt()
        token = (difference / scale.clamp_min(1e-30)).amax(0)
        samples.append({"id": sample.id, "tokens": length, "whole": whole.tolist(), "token": token.tolist()})
    layers = len(samples[0]["whole"]) if samples else 0
    result = {
        "reference_class": type(model).__name__, "dtype": args.dtype, "device": args.device, "load_s": load_s,
        "kernels": kernel_paths(model), "captured": captured if samples else [], "samples": samples,
        "per_layer_whole": [max(s["whole"][k] for s in samples) for k in range(layers)],
        "per_layer_token": [max(s["token"][k] for s in samples) for k in range(layers)],
    }
    result["worst_whole"] = max(result["per_layer_whole"], default=0.0)
    result["worst_token"] = max(result["per_layer_token"], default=0.0)
    (work / f"reference-{args.tag}.json").write_text(json.dumps(result))
    return 0


def reference_agreement(args: argparse.Namespace, model: Path, work: Path, store: str) -> dict[str, Any]:
    tag = "transformers-r1"
    command = [sys.executable, str(Path(__file__).resolve()), "--child", "reference", "--tag", tag, "--work",
               str(work), "--store", store, "--model-path", str(model), "--device", args.device, "--dtype",
               args.dtype, "--reference-samples", str(args.reference_samples)]
    with open(work / f"reference-{tag}.log", "w") as log:
        returncode = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO).returncode
    if returncode:
        tail = (work / f"reference-{tag}.log").read_text()[-4000:]
        raise SystemExit(f"the reference's process failed (exit {returncode}):\n{tail}")
    return json.loads((work / f"reference-{tag}.json").read_text())


def causal_pairs(length: int, window: int | None) -> int:
    """Query-key pairs causal attention computes over a sequence: every earlier position, or the last `window`."""
    if window is None or window >= length:
        return length * (length + 1) // 2
    return window * (window + 1) // 2 + (length - window) * window


def extraction_flops(text: Any, layers_run: int, lengths: list[int]) -> float:
    """Useful FLOPs of one prefill over each of `lengths` through the first `layers_run` decoder layers:

        2 * P                         per token, P = the parameters one token goes through in those layers
                                      (`count_parameters`: mixers, MLP or routed experts, norms): a multiply-add
                                      per weight;
      + 4 * heads * head_dim * pairs  per (full or sliding) attention layer: QK^T and AV over the causal
                                      query-key pairs (T(T+1)/2, or those inside the window);
      + 6 * H_v * d_k * d_v           per token per linear-attention layer (Gated DeltaNet's state, its recurrent
                                      form: read, delta update, decay, readout; the chunked kernels do a little more).

    The embedding lookup and the LM head are left out (the extract engine runs no head), and so is anything done
    twice (padding, a canary's rerun)."""
    from dflash_queue.ops.model_size import attention_dims, count_parameters, layer_kinds

    kinds = layer_kinds(text)[:layers_run]
    params = sum(count_parameters(text).active_layers[:layers_run])
    tokens = sum(lengths)
    heads, _, head_dim = attention_dims(text)
    window = getattr(text, "sliding_window", None)
    flops = 2.0 * params * tokens
    for kind in kinds:
        if kind == "full_attention":
            flops += 4.0 * heads * head_dim * sum(causal_pairs(n, None) for n in lengths)
        elif kind == "sliding_attention":
            flops += 4.0 * heads * head_dim * sum(causal_pairs(n, window) for n in lengths)
        elif kind == "linear_attention" and getattr(text, "linear_num_value_heads", None):
            state = int(text.linear_num_value_heads) * int(text.linear_key_head_dim) * int(text.linear_value_head_dim)
            flops += 6.0 * state * tokens
    return flops


class TreeMemory:
    """The peak summed RSS of a process and all its descendants, sampled in a thread."""

    def __init__(self, pid: int) -> None:
        import psutil

        self._root = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        import psutil

        processes = [self._root]
        listed = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            if now - listed >= LIST_INTERVAL_S:
                try:
                    processes = [self._root, *self._root.children(recursive=True)]
                except psutil.NoSuchProcess:
                    return
                listed = now
            total = 0
            for process in processes:
                try:
                    total += process.memory_info().rss
                except psutil.NoSuchProcess:
                    pass
            self.peak = max(self.peak, total)
            self._stop.wait(SAMPLE_INTERVAL_S)

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def run_engine(args: argparse.Namespace, model: Path, work: Path, engine: str, round_number: int) -> dict:
    tag = f"{engine}-r{round_number}"
    store, state = work / tag, work / f"state-{tag}"
    shutil.copytree(work / "inputs", store)
    config = config_path(args, model, engine, store, state)
    command = [sys.executable, str(Path(__file__).resolve()), "--child", engine, "--tag", tag, "--work", str(work),
               "--config", str(config)]
    with open(work / f"{tag}.log", "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
        memory = TreeMemory(process.pid)
        returncode = process.wait()
        peak = memory.stop()
    if returncode:
        tail = (work / f"{tag}.log").read_text()[-4000:]
        raise SystemExit(f"the {engine} engine's process failed (exit {returncode}):\n{tail}")
    result = json.loads((work / f"result-{tag}.json").read_text())
    result.update(round=round_number, peak_bytes=peak, store=str(store))
    return result


# -----------------------------------------------------------------------------------------------------------------
# Report


def agreement(first: Path, second: Path) -> tuple[float, int]:
    """Worst relative error per layer between the two stores' states of each sample, over every sample."""
    import torch

    from dflash_queue.engines.state_checks import compare_states
    from dflash_queue.training import ShardDataset

    mine = ShardDataset(first, hidden_dtype=torch.float32, on_bad_shard="raise")
    theirs = ShardDataset(second, hidden_dtype=torch.float32, on_bad_shard="raise")
    index = {theirs.meta(i).id: i for i in range(len(theirs))}
    if len(mine) != len(theirs) or set(index) != {mine.meta(i).id for i in range(len(mine))}:
        raise SystemExit(f"the engines stored different samples: {len(mine)} and {len(theirs)}")
    worst = 0.0
    for i in range(len(mine)):
        got, expected = mine[i], theirs[index[mine.meta(i).id]]
        if not torch.equal(got["input_ids"], expected["input_ids"]):
            raise SystemExit(f"sample {mine.meta(i).id}: the engines stored different token ids")
        worst = max(worst, compare_states(got["hidden_states"], expected["hidden_states"]).worst)
    return worst, len(mine)


def describe_model(model: Path) -> dict[str, Any]:
    from dflash_queue.engines.decoder import read_layout

    layout = read_layout(str(model))
    text: Any = layout.text_config
    return {
        "path": str(model),
        "model_type": str(getattr(layout.config, "model_type", "?")),
        "layers": int(text.num_hidden_layers),
        "hidden": int(text.hidden_size),
        "vocab": int(text.vocab_size),
    }


SETTINGS = ("device", "dtype", "hidden_dtype", "layers", "layer_ids", "shards", "shard_size", "min_len", "max_len",
            "token_budget", "max_model_len", "kv_cache_gib", "tensor_parallel_size", "rounds", "canary_samples")


def engine_order(engines: list[str], round_number: int) -> list[str]:
    """The engines in the order a round runs them: as given in odd rounds, reversed in even ones, so that neither
    always runs on the machine the other has just warmed (page cache, allocator, CPU frequency)."""
    return list(engines) if round_number % 2 else list(reversed(engines))


def plural(count: int, noun: str) -> str:
    return f"{count} {noun}{'' if count == 1 else 's'}"


def say_run(say: Any, result: dict, args: argparse.Namespace) -> None:
    engine, number, canary = result["engine"], result["round"], result["canary"]
    say(f"{engine}: {result['tokens'] / result['seconds']:.1f} tokens/s ({result['tokens']} tokens in "
        f"{result['seconds']:.6g} s), peak host memory {result['peak_bytes'] / GIB:.3f} GiB (round {number})")
    share = canary["alone_over_batched"] * canary["length_ratio"] * args.canary_samples / args.shard_size
    canary["shard_share"] = share
    say(f"canary: {engine} a sample alone costs {canary['alone_over_batched']:.3f}x the batched time per token "
        f"({canary['samples']} samples, {canary['tokens']} tokens in {canary['seconds']:.3f} s); at "
        f"{args.canary_samples} per {args.shard_size}-sample shard = {share:.5f} of the shard's extract time "
        f"(round {number})")


def read_text_config(model: Path) -> Any:
    from dflash_queue.engines.decoder import read_layout

    return read_layout(str(model)).text_config


def add_flops(result: dict, text: Any, shape: dict, measured: list[int], lengths: dict[str, list[int]],
              args: argparse.Namespace) -> None:
    """The run's useful FLOPs, TFLOP/s and MFU (and those of the engine timed alone on the first shard)."""
    layers = result["layers_run"] or shape["layers"]  # vLLM runs every layer
    result["layers_run"] = layers
    result["flops"] = extraction_flops(text, layers, measured)
    result["tflops"] = result["flops"] / result["seconds"] / 1e12
    result["mfu"] = result["tflops"] / args.peak_tflops
    alone = result.get("engine_alone")
    if alone:
        alone["flops"] = extraction_flops(text, layers, lengths[alone["shard"]])
        alone["tflops"] = alone["flops"] / alone["seconds"] / 1e12
        alone["mfu"] = alone["tflops"] / args.peak_tflops


def say_reference(say: Any, reference: dict) -> None:
    layers = ", ".join(f"{e:.2e}" for e in reference["per_layer_whole"])
    say(f"reference: transformers vs {reference['reference_class']} ({reference['dtype']}, each sample alone, "
        f"Transformers' PyTorch kernels) over {len(reference['samples'])} samples: worst relative error per layer "
        f"[{layers}], worst {reference['worst_whole']:.3e}, at a token {reference['worst_token']:.3e}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="an existing checkpoint directory")
    source.add_argument("--family", default="qwen3", help="a tiny family (dfq_testing.families), built into .cache")
    parser.add_argument("--quick", action="store_true", help="2 shards of 8 samples, 16-256 tokens (a smoke run)")
    parser.add_argument("--shards", type=int, help="measured shards (default 8)")
    parser.add_argument("--shard-size", type=int, help="samples per shard (default 64)")
    parser.add_argument("--min-len", type=int, help="shortest sequence, prompt + completion (default 32)")
    parser.add_argument("--max-len", type=int, help="longest sequence (default 2048)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds; each runs both engines, alternating first")
    parser.add_argument("--engines", default="transformers,vllm", help="engines to run (default both)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="default: float32 on the CPU, "
                        "bfloat16 on CUDA")
    parser.add_argument("--hidden-dtype", choices=["float32", "bfloat16", "float16", "fp8_e4m3"],
                        help="extract.hidden_dtype (default: the model's dtype)")
    parser.add_argument("--layers", type=int, help="K, extract.num_draft_layers (default 5, or N - 3 for N < 8)")
    parser.add_argument("--layer-ids", type=lambda s: [int(x) for x in s.split(",")], help="explicit ids, e.g. 1,3,5")
    parser.add_argument("--token-budget", type=int, default=16384,
                        help="extract.token_budget (Transformers' tokens a pass; vLLM's a step unless told otherwise)")
    parser.add_argument("--canary-samples", type=int, default=1, help="extract.canary_samples, run in every task")
    parser.add_argument("--canary-measured", type=int, default=8, help="samples rerun alone after the timed part")
    parser.add_argument("--tensor-parallel-size", type=int, default=1, help="extract.vllm.tensor_parallel_size")
    parser.add_argument("--max-model-len", type=int, help="extract.vllm.max_model_len (default: --max-len rounded up "
                        "to 256 above it)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=0,
                        help="extract.vllm.max_num_batched_tokens, the vLLM engine's tokens a step (0: --token-budget, "
                        "as the worker's default is extract.token_budget)")
    parser.add_argument("--kv-cache-gib", type=float, help="extract.vllm.kv_cache_memory_gib (default 0.5 on the "
                        "CPU; on CUDA 0: sized by vLLM)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="vLLM without torch.compile or CUDA graphs (always on the CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="work directory, kept (default: a temporary one, removed)")
    parser.add_argument("--json", action="store_true", help="the report as one JSON object on stdout (text to stderr)")
    parser.add_argument("--json-file", type=Path, help="also write the report as JSON to this file")
    parser.add_argument("--peak-tflops", type=float, default=790.0,
                        help="the device's peak for MFU (default 790: one H200, bfloat16)")
    parser.add_argument("--reference-samples", type=int, default=0,
                        help="compare this many of the Transformers engine's stored samples (first round) with the "
                        "checkpoint's own class run alone in --dtype (default 0: none)")
    parser.add_argument("--child", choices=[*ENGINES, "reference"], help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--model-path", help=argparse.SUPPRESS)
    parser.add_argument("--tag", help=argparse.SUPPRESS)
    parser.add_argument("--work", help=argparse.SUPPRESS)
    parser.add_argument("--config", help=argparse.SUPPRESS)
    return parser


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    defaults = (2, 8, 16, 256) if args.quick else (8, 64, 32, 2048)
    for name, value in zip(("shards", "shard_size", "min_len", "max_len"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    if not 2 <= args.min_len <= args.max_len:
        parser.error("need 2 <= --min-len <= --max-len")
    args.engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    if not args.engines or any(e not in ENGINES for e in args.engines):
        parser.error(f"--engines: a comma-separated subset of {','.join(ENGINES)}")
    args.dtype = args.dtype or ("float32" if args.device == "cpu" else "bfloat16")
    args.hidden_dtype = args.hidden_dtype or args.dtype
    args.max_model_len = args.max_model_len or (args.max_len // 256 + 1) * 256
    if args.kv_cache_gib is None:
        args.kv_cache_gib = 0.5 if args.device == "cpu" else 0.0
    args.enforce_eager = args.enforce_eager or args.device == "cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.child == "reference":
        return run_reference(args)
    if args.child:
        return run_child(args)
    out = sys.stderr if args.json else sys.stdout

    def say(line: str) -> None:
        print(line, file=out, flush=True)

    import psutil

    baseline = psutil.Process().memory_info().rss  # before any model or engine code is loaded here
    model = resolve_model(args)
    shape = describe_model(model)
    if args.layers is None and not args.layer_ids:
        args.layers = max(1, min(5, shape["layers"] - 3))
    if args.reference_samples and "transformers" not in args.engines:
        raise SystemExit("--reference-samples checks the Transformers engine's states: add it to --engines")
    work = args.out or Path(tempfile.mkdtemp(prefix="dfq-bench-extract-"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        shard_ids = [f"bench-{i:03d}" for i in range(args.shards)]
        (work / "shards.json").write_text(json.dumps(shard_ids))
        shutil.rmtree(work / "inputs", ignore_errors=True)
        lengths = write_inputs(work / "inputs", shard_ids, args, shape["vocab"])
        measured = [n for shard in shard_ids for n in lengths[shard]]
        layers = f"ids {args.layer_ids}" if args.layer_ids else f"K={args.layers} (DFlash ids)"
        say(f"model: {shape['path']} ({shape['model_type']}, {shape['layers']} layers, hidden {shape['hidden']}), "
            f"{args.dtype} on {args.device}; layers {layers}, stored {args.hidden_dtype}; vLLM: max_model_len "
            f"{args.max_model_len}, kv cache {args.kv_cache_gib:g} GiB (0: vLLM's), tensor parallel "
            f"{args.tensor_parallel_size}; Transformers: token budget {args.token_budget}")
        say(f"workload: {args.shards} shards x {args.shard_size} samples ({args.min_len}-{args.max_len} tokens each, "
            f"log-uniform), plus a 2-sample warm-up shard (not timed); {plural(args.rounds, 'round')}")
        say(f"parent: host memory {baseline / GIB:.3f} GiB (baseline: this process before loading a model)")

        results: dict[str, list[dict]] = {engine: [] for engine in args.engines}
        rounds: list[dict] = []
        agree: dict[str, Any] | None = None
        reference: dict[str, Any] | None = None
        text = read_text_config(model)
        for number in range(1, args.rounds + 1):
            order = engine_order(args.engines, number)
            load, this = os.getloadavg()[0], {}
            for engine in order:
                this[engine] = result = run_engine(args, model, work, engine, number)
                results[engine].append(result)
                add_flops(result, text, shape, measured, lengths, args)
                say_run(say, result, args)
            if number == 1 and args.reference_samples:
                reference = reference_agreement(args, model, work, this["transformers"]["store"])
                say_reference(say, reference)
            if len(this) == 2:
                v, t = this["vllm"], this["transformers"]
                if v["tokens"] != t["tokens"]:
                    raise SystemExit("the engines extracted different numbers of tokens")
                ratio = (v["tokens"] / v["seconds"]) / (t["tokens"] / t["seconds"])
                rounds.append({"round": number, "first": order[0], "ratio": ratio, "load_average": load})
                say(f"round {number}: ratio vllm/transformers {ratio:.3f} x ({order[0]} first; load average "
                    f"{load:.2f} at its start)")
                if agree is None:
                    worst, samples = agreement(Path(v["store"]), Path(t["store"]))
                    agree = {"worst_relative_error": worst, "samples": samples}
                    say(f"agreement: worst relative error {worst:.3e} (vllm vs transformers, per layer, over "
                        f"{samples} samples, {args.dtype})")
            for result in this.values():
                shutil.rmtree(result["store"], ignore_errors=True)

        report: dict[str, Any] = {"model": shape, "baseline_bytes": baseline, "engines": {}, "rounds": rounds,
                                  "agreement": agree, "reference_agreement": reference,
                                  "peak_tflops": args.peak_tflops, "settings": {k: vars(args)[k] for k in SETTINGS}}
        medians = {}
        for engine, runs in results.items():
            medians[engine] = statistics.median(r["tokens"] / r["seconds"] for r in runs)
            peak = max(r["peak_bytes"] for r in runs)
            summary = report["engines"][engine] = {
                "median_tokens_per_s": medians[engine], "peak_bytes": peak, "runs": runs,
                "median_mfu": statistics.median(r["mfu"] for r in runs),
                "median_canary_share": statistics.median(r["canary"]["shard_share"] for r in runs),
                "flops_per_token": runs[-1]["flops"] / runs[-1]["tokens"], "layers_run": runs[-1]["layers_run"],
                "kernels": runs[-1]["kernels"], "mode": runs[-1]["mode"],
            }
            alone = [r["engine_alone"] for r in runs if r.get("engine_alone")]
            if alone:
                summary["engine_alone"] = {
                    "median_tokens_per_s": statistics.median(a["tokens"] / a["seconds"] for a in alone),
                    "median_mfu": statistics.median(a["mfu"] for a in alone),
                }
            say(f"{engine}: median {medians[engine]:.1f} tokens/s over {plural(len(runs), 'round')}, peak host memory "
                f"{peak / GIB:.3f} GiB (largest), load {runs[-1]['load_s']:.1f} s, {runs[-1]['task_slots']} task "
                f"slots, mode {runs[-1]['mode']}")
            say(f"{engine}: median MFU {summary['median_mfu']:.4g} against {args.peak_tflops:g} TFLOP/s "
                f"({summary['flops_per_token'] / 1e9:.4g} GFLOP per token over {summary['layers_run']} layers)"
                + (f"; the engine alone (no lane) {summary['engine_alone']['median_tokens_per_s']:.1f} tokens/s, "
                   f"MFU {summary['engine_alone']['median_mfu']:.4g}" if alone else "")
                + (f"; kernels: {', '.join(f'{k} = {v}' for k, v in summary['kernels'].items())}"
                   if summary["kernels"] else ""))
        if len(medians) == 2:
            report["ratio"] = medians["vllm"] / medians["transformers"]
            say(f"ratio vllm/transformers: {report['ratio']:.3f} x (median of {plural(args.rounds, 'round')})")
        if args.json:
            print(json.dumps(report))
        if args.json_file:
            args.json_file.write_text(json.dumps(report, indent=1) + "\n")
    finally:
        if args.out is None:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
