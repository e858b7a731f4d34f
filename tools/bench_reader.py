"""Random-access read throughput of ShardDataset against plain safetensors, and shard bytes per token.

Shards are written by the project's own writer (random states at a real model's width: K=5, H=5120 by
default), once as bfloat16 and once as fp8_e4m3 holding the same samples. Then, in alternating rounds over
the same shuffled sample order:

* reader:   `ShardDataset[i]` (ranged reads of one sample's rows, fp8 dequantised to bfloat16, or, "as
            stored", fp8 states and scales returned for dequantising on the GPU);
* baseline: `safe_open` handles kept open per shard + `get_slice` with the same offsets (for fp8, the same
            dequantisation), i.e. the same bytes read the plain safetensors way.

Prints samples/s and MB/s (shard bytes per second) for both and reader / baseline (target >= 0.8), and the
shard bytes per token of both dtypes.

    .venv/bin/python tools/bench_reader.py [--samples 48] [--tokens 512] [--hidden 5120] [--layers 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_queue.shards.fp8 import dequantize_fp8  # noqa: E402
from dflash_queue.shards.training import ExtractedSample, ShardInfo  # noqa: E402
from dflash_queue.shards.training_writer import write_training_shard  # noqa: E402
from dflash_queue.training import ShardDataset  # noqa: E402


def make_shards(root: Path, *, samples: int, per_shard: int, tokens: int, layers: int, hidden: int) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.clamp(torch.randn(samples, generator=gen) * tokens / 3 + tokens, min=16).long().tolist()
    for dtype in ("bfloat16", "fp8_e4m3"):
        info = ShardInfo("bench", tuple(range(1, 1 + 2 * layers, 2)), 2 * layers + 4, hidden, dtype, "bench", {})
        (root / dtype).mkdir(parents=True)
        for start in range(0, samples, per_shard):
            batch = []
            for i in range(start, min(start + per_shard, samples)):
                g = torch.Generator().manual_seed(i)
                n = lengths[i]
                batch.append(
                    ExtractedSample(
                        id=f"s{i}",
                        input_ids=torch.randint(0, 150_000, (n,), generator=g, dtype=torch.int32),
                        loss_mask=(torch.arange(n) >= n // 3).to(torch.uint8),
                        hidden_states=torch.randn(n, layers, hidden, generator=g, dtype=torch.float32).to(torch.bfloat16),
                        finish_reason="stop",
                        thinking=True,
                    )
                )
            write_training_shard(root / dtype / f"{start:06d}.safetensors", batch, info)


class PlainSafetensors:
    """The same samples through safe_open + get_slice, handles kept open. get_slice returns a view of the
    memory-mapped file, whose bytes are read only when touched: each slice is cloned, so that, as with the
    reader, the sample is in the process's memory when the call returns."""

    def __init__(self, dataset: ShardDataset, root: Path) -> None:
        self.dataset = dataset
        self.handles = [safe_open(str(root / key), framework="pt") for key in dataset.keys]
        self.fp8 = dataset.shards[0].dtype == "fp8_e4m3" and dataset.dequantize
        self.scales = dataset.shards[0].dtype == "fp8_e4m3" and not dataset.dequantize

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        position, row = self.dataset._locate(i)
        start, end = self.dataset.shards[position].rows(row)
        handle = self.handles[position]
        hidden = handle.get_slice("hidden_states")[start:end]
        if self.fp8:  # dequantising reads every byte and makes a new tensor
            hidden = dequantize_fp8(hidden, handle.get_slice("hidden_scales")[start:end], torch.bfloat16)
        else:
            hidden = hidden.clone()
        out = {
            "input_ids": handle.get_slice("input_ids")[start:end].clone(),
            "loss_mask": handle.get_slice("loss_mask")[start:end].clone(),
            "hidden_states": hidden,
        }
        if self.scales:
            out["hidden_scales"] = handle.get_slice("hidden_scales")[start:end].clone()
        return out


def stored_bytes(dataset: ShardDataset, order: list[int]) -> int:
    total = 0
    for i in order:
        position, row = dataset._locate(i)
        index = dataset.shards[position]
        start, end = index.rows(row)
        total += sum(spec.row_bytes * (end - start) for name, spec in index.layout.tensors.items() if name != "offsets")
    return total


def timed(reader, order: list[int]) -> float:
    began = time.perf_counter()
    for i in order:
        item = reader[i]
        assert item["hidden_states"].dtype in (torch.bfloat16, torch.float8_e4m3fn)
    return time.perf_counter() - began


def compare(dataset: ShardDataset, root: Path, rounds: int) -> dict[str, float]:
    baseline = PlainSafetensors(dataset, root)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(1)).tolist()
    for i in order[:4]:  # the two sides return the same tensors
        mine, theirs = dataset[i], baseline[i]
        assert mine.keys() >= theirs.keys()
        assert all(torch.equal(mine[k].to(theirs[k].dtype).view(torch.uint8), theirs[k].view(torch.uint8)) for k in theirs)
    timed(dataset, order), timed(baseline, order)  # warm the page cache for both
    reader_times, baseline_times = [], []
    for _ in range(rounds):
        reader_times.append(timed(dataset, order))
        baseline_times.append(timed(baseline, order))
    nbytes = stored_bytes(dataset, order)
    reader_s, baseline_s = statistics.median(reader_times), statistics.median(baseline_times)
    return {
        "reader_sps": len(order) / reader_s,
        "baseline_sps": len(order) / baseline_s,
        "reader_mbps": nbytes / reader_s / 1e6,
        "baseline_mbps": nbytes / baseline_s / 1e6,
        "ratio": baseline_s / reader_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=48)
    parser.add_argument("--per-shard", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=512, help="mean tokens per sample")
    parser.add_argument("--layers", type=int, default=5, help="K")
    parser.add_argument("--hidden", type=int, default=5120, help="H")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="where to write the shards (default: a temp dir)")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="dfq-bench-reader-", dir=args.dir) as tmp:
        root = Path(tmp)
        make_shards(
            root, samples=args.samples, per_shard=args.per_shard, tokens=args.tokens, layers=args.layers, hidden=args.hidden
        )
        print(f"{args.samples} samples, mean {args.tokens} tokens, K={args.layers}, H={args.hidden}, "
              f"{args.per_shard} samples per shard; median of {args.rounds} alternating rounds, page cache warm")
        sizes = {}
        for dtype, dequantize, label in (
            ("bfloat16", True, "bfloat16"),
            ("fp8_e4m3", True, "fp8 -> bf16"),
            ("fp8_e4m3", False, "fp8 stored"),
        ):
            dataset = ShardDataset(root / dtype, dequantize=dequantize)
            result = compare(dataset, root / dtype, args.rounds)
            sizes[dtype] = sum(p.stat().st_size for p in (root / dtype).glob("*.safetensors")) / dataset.num_tokens
            print(
                f"{label:11s} reader {result['reader_sps']:7.1f} samples/s {result['reader_mbps']:7.0f} MB/s | "
                f"safetensors {result['baseline_sps']:7.1f} samples/s {result['baseline_mbps']:7.0f} MB/s | "
                f"reader / safetensors {result['ratio']:.2f} (target >= 0.8)"
            )
        print(
            f"shard bytes per token: bfloat16 {sizes['bfloat16']:.0f}, fp8_e4m3 {sizes['fp8_e4m3']:.0f} "
            f"(fp8 / bf16 = {sizes['fp8_e4m3'] / sizes['bfloat16']:.3f})"
        )


if __name__ == "__main__":
    main()
