#!/usr/bin/env python
"""Extract engine throughput against a naive `output_hidden_states=True` padded loop, on one random-weight model.

Builds a random-weight Qwen3 base model of a real size on the device (nothing is downloaded), then extracts
K=5 layers' hidden states for the same sequences two ways, in the same run:

  engine  HiddenStateExtractor: packed sequences up to --token-budget tokens, per-sequence causal attention,
          layers above the highest captured one dropped, captured layers copied to pinned host memory while
          the next pack computes;
  naive   batches of --naive-batch sequences in arrival order, right-padded, `output_hidden_states=True` on the
          whole model, the K layers picked from the tuple and copied to the host sample by sample.

Sizes: 8b (36 layers, hidden 4096, intermediate 12288, 32 heads / 8 kv heads, head_dim 128), 32b (64 layers,
hidden 5120, intermediate 25600, 64 / 8 heads, head_dim 128) and tiny (a CPU smoke run of the script itself).

FLOP count (useful work, the same for both ways): for the decoder layers extraction needs (0 .. highest
captured layer, L of them) over the real tokens,
    FLOPs = 2 * P * sum(len)  +  4 * L * d_attn * sum(len^2) / 2
P is the parameter count of those L layers (no embedding, no LM head: a lookup and an unused output), 2 * P
per token for the matrix multiplies; 4 * d_attn * len^2 per layer for QK^T and AV (d_attn = heads * head_dim,
= hidden for the 8B class), halved because attention is causal. Padding, the layers above the highest
captured one and a masked attention's wasted pairs are not counted: they are the naive loop's waste.
Achieved TFLOP/s = FLOPs / wall time; MFU = achieved / --peak-tflops (790: H200 bf16, measured).

The run-time canary (each shard recomputes `extract.canary_samples` samples alone and compares them): the time
per token of --canary-measured samples run alone through the model's own attention and compared, over the
engine's time per token. The lane draws canaries from samples no longer than the shard's median, so a canary
runs E[len | len <= median] tokens where the average sample has mean(len) (from this workload's lengths); the
share of a shard's extract time the canary costs is ratio x that length ratio x canary samples / shard size
(target: at most 1 / shard size at the default of one canary sample).

    python tools/bench_extract_gpu.py [--size 8b|32b] [--samples 200] [--token-budget 16384]
    python tools/bench_extract_gpu.py --size tiny --device cpu [--threads 1]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_queue.engines.hf.extract import ExtractionRequest, HiddenStateExtractor  # noqa: E402
from dflash_queue.engines.layers import resolve_layer_ids  # noqa: E402
from dflash_queue.engines.state_checks import compare_states  # noqa: E402

SIZES = {
    "tiny": dict(layers=8, hidden=128, intermediate=384, heads=2, kv_heads=1, head_dim=64, vocab=1536),
    "8b": dict(layers=36, hidden=4096, intermediate=12288, heads=32, kv_heads=8, head_dim=128, vocab=151936),
    "32b": dict(layers=64, hidden=5120, intermediate=25600, heads=64, kv_heads=8, head_dim=128, vocab=151936),
}
# Workload defaults per size: (samples, shortest, longest, token budget, naive batch).
WORKLOADS = {"tiny": (24, 32, 384, 1024, 4), "8b": (200, 1024, 4096, 16384, 4), "32b": (200, 1024, 4096, 16384, 4)}
GIB = 2**30


def build_model(size: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3Model

    s = SIZES[size]
    config = Qwen3Config(
        vocab_size=s["vocab"],
        hidden_size=s["hidden"],
        intermediate_size=s["intermediate"],
        num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"],
        num_key_value_heads=s["kv_heads"],
        head_dim=s["head_dim"],
        max_position_embeddings=40960,
        rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3Model._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def useful_flops(model: torch.nn.Module, num_layers: int, lengths: list[int]) -> float:
    config = model.config
    params = sum(p.numel() for layer in list(model.layers)[:num_layers] for p in layer.parameters())
    d_attn = config.num_attention_heads * config.head_dim
    return 2.0 * params * sum(lengths) + 4.0 * num_layers * d_attn * sum(n * n for n in lengths) / 2


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def naive_extract(model, requests, layer_ids, batch_size: int) -> list[torch.Tensor]:
    device = next(model.parameters()).device
    out = []
    for start in range(0, len(requests), batch_size):
        batch = requests[start : start + batch_size]
        width = max(len(r.input_ids) for r in batch)
        ids = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, r in enumerate(batch):
            ids[row, : len(r.input_ids)] = torch.tensor(r.input_ids)
            mask[row, : len(r.input_ids)] = 1
        output = model(input_ids=ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
        hidden = output.hidden_states
        for row, r in enumerate(batch):
            out.append(torch.stack([hidden[i + 1][row, : len(r.input_ids)] for i in layer_ids], dim=1).cpu())
        del output, hidden
    return out


def report(name: str, tokens: int, flops: float, seconds: float, peak_tflops: float) -> float:
    achieved = flops / seconds / 1e12
    print(
        f"{name}: {tokens / seconds:.1f} tokens/s, {achieved:.4g} TFLOP/s, MFU {achieved / peak_tflops:.4g} "
        f"({seconds:.4g} s)"
    )
    return tokens / seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="8b")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"], default="auto", help="auto: bf16 on CUDA")
    parser.add_argument("--samples", type=int)
    parser.add_argument("--min-len", type=int)
    parser.add_argument("--max-len", type=int)
    parser.add_argument("--token-budget", type=int)
    parser.add_argument("--naive-batch", type=int)
    parser.add_argument("--num-draft-layers", type=int, default=5)
    parser.add_argument("--attn", choices=["sdpa", "flash_attention_2", "eager"], default="sdpa")
    parser.add_argument("--peak-tflops", type=float, default=790.0)
    parser.add_argument("--skip-naive", action="store_true")
    parser.add_argument("--threads", type=int, help="CPU threads for torch (1 gives steadier figures on a busy CPU)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--shard-size", type=int, default=256, help="dataset.shard_size the canary share is for")
    parser.add_argument("--canary-samples", type=int, default=1, help="extract.canary_samples")
    parser.add_argument("--canary-measured", type=int, default=8, help="samples run alone to time the canary")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    samples, shortest, longest, budget, naive_batch = WORKLOADS[args.size]
    samples = args.samples or samples
    shortest, longest = args.min_len or shortest, args.max_len or longest
    budget, naive_batch = args.token_budget or budget, args.naive_batch or naive_batch

    device = torch.device(args.device)
    if args.dtype == "auto":
        args.dtype = "bfloat16" if device.type == "cuda" else "float32"
    dtype = getattr(torch, args.dtype)
    model = build_model(args.size, device, dtype)
    s = SIZES[args.size]
    layer_ids = resolve_layer_ids((), s["layers"], args.num_draft_layers)
    run_layers = max(layer_ids) + 1
    rng = random.Random(args.seed)
    requests = [
        ExtractionRequest(str(i), [rng.randrange(s["vocab"]) for _ in range(rng.randint(shortest, longest))])
        for i in range(samples)
    ]
    lengths = [len(r.input_ids) for r in requests]
    tokens = sum(lengths)
    flops = useful_flops(model, run_layers, lengths)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(
        f"model: qwen3 {args.size}-class random weights, {s['layers']} layers ({run_layers} run by the engine), "
        f"hidden {s['hidden']}, intermediate {s['intermediate']}, heads {s['heads']}/{s['kv_heads']}, "
        f"head_dim {s['head_dim']}, {weights / GIB:.2f} GiB of weights, {device.type} {args.dtype}, attn {args.attn}"
    )
    print(
        f"workload: {samples} sequences, {tokens} tokens ({shortest}-{longest} each), K={len(layer_ids)} layers "
        f"{list(layer_ids)}, token budget {budget}, naive batch {naive_batch}; useful work {flops / 1e12:.4g} TFLOP"
    )

    naive_rate = None
    reference = None
    if not args.skip_naive:
        naive_extract(model, requests[:1], layer_ids, 1)  # warm-up
        synchronize(device)
        start = time.perf_counter()
        naive_states = naive_extract(model, requests, layer_ids, naive_batch)
        synchronize(device)
        naive_seconds = time.perf_counter() - start
        reference = naive_states[0]
        del naive_states
        naive_rate = report("naive", tokens, flops, naive_seconds, args.peak_tflops)

    extractor = HiddenStateExtractor.from_model(
        model, layer_ids=layer_ids, token_budget=budget, attn_implementation=args.attn
    )
    extractor.extract(requests[:2])  # warm-up
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    synchronize(device)
    start = time.perf_counter()
    states = extractor.extract(requests)
    synchronize(device)
    engine_seconds = time.perf_counter() - start
    engine_rate = report("engine", tokens, flops, engine_seconds, args.peak_tflops)
    if naive_rate is not None:
        print(f"speedup engine/naive: {engine_rate / naive_rate:.2f}x")
    if extractor.effective_token_budget != budget:
        print(f"note: out of memory; the token budget shrank to {extractor.effective_token_budget}")
    if device.type == "cuda":
        kept = sum(p.numel() * p.element_size() for p in extractor.model.parameters())
        measured = torch.cuda.max_memory_allocated(device) - kept
        predicted = extractor.activation_bytes(extractor.effective_token_budget)
        print(f"peak memory beyond weights: measured {measured / GIB:.2f} GiB, predicted {predicted / GIB:.2f} GiB")
    median = sorted(lengths)[(len(lengths) - 1) // 2]
    short = [n for n in lengths if n <= median]
    canary_length = sum(short) / len(short) / (tokens / len(lengths))
    # The samples the lane would pick: no longer than the median.
    eligible = [i for i, n in enumerate(lengths) if n <= median][: max(1, args.canary_measured)]
    measured = [requests[i] for i in eligible]
    synchronize(device)
    start = time.perf_counter()
    worst = max(
        compare_states(states[i].to(device), extractor.reference_states(requests[i], on_device=True)).worst
        for i in eligible
    )
    synchronize(device)
    canary_seconds = time.perf_counter() - start
    alone_over_packed = (canary_seconds / sum(len(r.input_ids) for r in measured)) / (engine_seconds / tokens)
    share = alone_over_packed * canary_length * args.canary_samples / args.shard_size
    print(
        f"canary: a sample alone (+ compare) costs {alone_over_packed:.3f}x its packed time per token "
        f"({len(measured)} samples, worst relative error {worst:.2e}); canaries of at most the median length run "
        f"{canary_length:.3f}x the mean sample; {args.canary_samples} per {args.shard_size}-sample shard = "
        f"{share:.5f} of the shard's extract time (target <= {1 / args.shard_size:.5f})"
    )
    if reference is not None:
        diff = (states[0].float() - reference.float()).abs().max().item()
        scale = reference.float().abs().max().item()
        print(f"check: sample 0, max |engine - naive| {diff:.4g} (max |naive| {scale:.4g})")
    ceiling = tokens / (flops / (args.peak_tflops * 1e12))
    print(f"compute-bound ceiling for this workload at {args.peak_tflops:g} TFLOP/s: {ceiling:.0f} tokens/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
