"""The host path of one sample's hidden states, whole, engine to stored shard, through the production code; beside it
a copy of the same bytes into memory already mapped, and the rate at which one GPU produces states.

One sample of the given shape ([tokens, layers, hidden] in --dtype, on --device) goes, in each round, through:

* copy:         the same bytes copied into host memory mapped beforehand (on CUDA: pinned, from the device): the
                machine's copy bandwidth, which no path that copies the bytes once can pass;
* transformers: the Transformers engine's hand-over (engines/hf/extract.py): `finish_pass` reduces the token
                statistics where the states are (on CUDA it also copies states and statistics to pinned host
                memory on a side stream), `hand_over` checks and summarises them, and the shard writer stores the
                states in a local shard file (`TrainingShardWriter.write` + `finish`);
* vllm:         the vLLM engine's, from its hidden-state cache ([blocks, K, block size, H] on the device, the
                sample's rows in scattered blocks) to the same shard: the connector's `StatesSender.send`
                (engines/vllm/states_sender.py: the rows gathered, their statistics, on CUDA the copy to pinned host
                memory and the writing thread, the transfer file in a tmpfs), then the worker's `receive_states`
                (the file mapped, checked from its token ids and statistics), the finiteness check and summary its
                capture makes, and the writer. "connector" is the first part alone (vLLM's process).

Beside them, the GPU's state rate: one GPU at --mfu of --peak-tflops running the target of --model-config (the
seed's, examples/qwen3.6-27b-class: hidden 5120, 64 layers) over sequences of --tokens tokens, up to the deepest of
DFlash's --layers layer ids, makes tokens/s = mfu x peak / FLOPs per token (`extraction_flops` of
tools/bench_extract.py: 2 x the weights a token goes through, plus attention's), each token's states K x the
target's hidden x the dtype's bytes. The peak is the H100's and H200's datasheet bfloat16 dense figure (989
TFLOP/s); the extract benchmarks take 790, a measured one, against which the rate would be a fifth lower. An
engine's host path keeps up with one GPU while its GB/s is above that rate.

The forms run in turn within each round (the order rotates), so load from other processes falls on all of them;
each figure is the median over the rounds.

    tools/bench_host_path.py [--device cpu|cuda] [--tokens 2000] [--layers 5] [--hidden 5120] [--dtype bfloat16]
                             [--repeats N] [--model-config DIR] [--mfu 0.6] [--peak-tflops 989] [--json FILE]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_queue.engines.base import CapturedStates, ExtractionRequest  # noqa: E402
from dflash_queue.engines.hf.extract import finish_pass, hand_over  # noqa: E402
from dflash_queue.engines.layers import resolve_layer_ids  # noqa: E402
from dflash_queue.engines.passes import all_finite, summarize  # noqa: E402
from dflash_queue.engines.vllm.states_file import receive_states  # noqa: E402
from dflash_queue.engines.vllm.states_sender import StatesSender, StatesTransfer  # noqa: E402
from dflash_queue.shards.training import ShardInfo, TrainingShard  # noqa: E402
from dflash_queue.shards.training_writer import ShardRow, TrainingShardWriter  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
FORMS = ("copy", "transformers", "vllm")
ENGINES = ("transformers", "vllm")
SEED_MODEL = REPO / "examples" / "qwen3.6-27b-class"
# vLLM's default KV-cache block size on a GPU; the cache holds twice the sample's blocks, its own scattered in it.
BLOCK_SIZE = 16


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--layers", type=int, default=5, help="K: captured layers")
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of every form (median reported)")
    parser.add_argument("--model-config", type=Path, default=SEED_MODEL,
                        help="the target whose GPU state rate is shown (a directory with config.json)")
    parser.add_argument("--mfu", type=float, default=0.6, help="the GPU's share of its peak for the state rate")
    parser.add_argument("--peak-tflops", type=float, default=989.0,
                        help="the GPU's peak (989: one H100 or H200 SXM, bfloat16 dense)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.tokens, args.layers, args.hidden, args.repeats) < 1:
        parser.error("--tokens, --layers, --hidden and --repeats must be >= 1")
    if not 0 < args.mfu <= 1 or args.peak_tflops <= 0:
        parser.error("--mfu must be in (0, 1] and --peak-tflops > 0")
    if not (args.model_config / "config.json").is_file():
        parser.error(f"--model-config {args.model_config}: no config.json there")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    return args


def transfer_dir() -> Path:
    """A tmpfs like the engine's transfer directory (/dev/shm), else the temporary directory."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="dfq-bench-host-", dir=base))


def refuse(path: str, message: str, *, io_error: bool = False) -> None:
    """The sender's report of a failed hand-over: here a failed run."""
    raise RuntimeError(message)


class HostPath:
    """One sample's states, where each engine holds them, and what each form needs to hand them over."""

    def __init__(self, args: argparse.Namespace, work: Path, transfer: Path) -> None:
        self.device = torch.device(args.device)
        self.dtype = DTYPES[args.dtype]
        shape = (args.tokens, args.layers, args.hidden)
        generator = torch.Generator().manual_seed(0)
        host_states = torch.randn(shape, generator=generator).to(self.dtype)
        self.states = host_states.to(self.device)
        self.nbytes = self.states.numel() * self.states.element_size()
        # The copy's destination, its pages mapped (and pinned, on CUDA) before any round.
        self.mapped = torch.zeros(shape, dtype=self.dtype, pin_memory=self.device.type == "cuda")
        # The vLLM engine's cache: the sample's blocks spread among as many others.
        blocks = -(-args.tokens // BLOCK_SIZE)
        order = torch.randperm(2 * blocks, generator=generator)
        self.block_ids = order[:blocks].tolist()
        cache = torch.zeros((2 * blocks, args.layers, BLOCK_SIZE, args.hidden), dtype=self.dtype)
        padded = torch.zeros((blocks * BLOCK_SIZE, args.layers, args.hidden), dtype=self.dtype)
        padded[: args.tokens] = host_states
        cache[order[:blocks]] = padded.view(blocks, BLOCK_SIZE, args.layers, args.hidden).transpose(1, 2)
        self.sender = StatesSender(cache.to(self.device), BLOCK_SIZE, refuse)
        self.ids = torch.randint(0, 150_000, (args.tokens,), generator=generator, dtype=torch.int32)
        self.row = ShardRow("bench", self.ids, torch.ones(args.tokens, dtype=torch.uint8), "stop", False)
        self.request = ExtractionRequest("bench", self.ids.tolist())
        self.aux_ids = list(range(1, args.layers + 1))
        self.columns = torch.arange(args.layers)
        self.info = ShardInfo(
            "bench", tuple(range(args.layers)), args.layers + 1, args.hidden, args.dtype, "bench",
            {"torch": torch.__version__},
        )
        self.work, self.transfer = work, transfer
        self.shard = work / "shard.safetensors"
        self.copy_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.connector_s: list[float] = []
        self._file = 0

    def copy(self) -> None:
        self.mapped.copy_(self.states)

    def _store(self, captured: CapturedStates) -> None:
        """The stored local shard (removed after each timed round, `tidy`)."""
        with TrainingShardWriter(self.shard, [self.row], self.info) as writer:
            writer.write(0, captured.states, captured.summary)
            writer.finish()

    def tidy(self) -> None:
        self.shard.unlink(missing_ok=True)

    def check_stored(self, form: str) -> None:
        """The stored shard holds the sample's states, its token ids in its order (an untimed round's check)."""
        sample = TrainingShard(self.shard)[0]
        if not torch.equal(sample.input_ids, self.ids) or not torch.equal(sample.hidden_states, self.states.cpu()):
            raise RuntimeError(f"{form}: the stored shard does not hold the sample's states")

    def transformers(self) -> None:
        result = finish_pass([0], [(0, self.states.shape[0])], self.states, self.copy_stream)
        delivered: dict[int, CapturedStates] = {}
        nonfinite: list[str] = []
        hand_over(result, [self.request], delivered.__setitem__, nonfinite)
        assert not nonfinite, "random states cannot be non-finite"
        self._store(delivered[0])

    def vllm(self) -> None:
        """The connector's hand-over into the transfer file (timed on its own too), then the worker's."""
        self._file += 1
        request_id = f"bench-{self._file}"
        path = self.transfer / f"c{self._file}.safetensors"
        started = time.perf_counter()
        pending = self.sender.send(StatesTransfer(request_id, str(path), self.block_ids, self.request.input_ids))
        if pending is not None:
            pending.result()
        assert request_id in self.sender.done()
        self.connector_s.append(time.perf_counter() - started)
        received = receive_states(path, "bench", self.request.input_ids, self.aux_ids, self.columns, self.info.hidden_size)
        assert all_finite(received.stats), "random states cannot be non-finite"
        self._store(CapturedStates(received.states, summarize(received.stats)))


def timed(run: Callable[[], None], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started


def measure(path: HostPath, repeats: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {form: [] for form in FORMS}
    for form in FORMS:  # a first, untimed round (allocator caches, page cache, kernels), its shards checked
        getattr(path, form)()
        if form in ENGINES:
            path.check_stored(form)
        path.tidy()
    path.connector_s.clear()
    for number in range(repeats):
        order = FORMS[number % len(FORMS):] + FORMS[: number % len(FORMS)]
        for form in order:
            times[form].append(timed(getattr(path, form), path.device))
            path.tidy()
    return times


def load_extraction_flops() -> Callable[..., float]:
    """`extraction_flops` of tools/bench_extract.py (the extract benchmarks' measure of useful work)."""
    spec = importlib.util.spec_from_file_location("bench_extract", Path(__file__).with_name("bench_extract.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.extraction_flops


def gpu_state_rate(args: argparse.Namespace) -> dict[str, Any]:
    """The bytes of states per second one GPU makes at --mfu of --peak-tflops on --model-config's target."""
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(args.model_config).get_text_config()
    layer_ids = resolve_layer_ids((), int(text.num_hidden_layers), args.layers)
    layers_run = max(layer_ids) + 1
    flops_per_token = load_extraction_flops()(text, layers_run, [args.tokens]) / args.tokens
    tokens_per_s = args.mfu * args.peak_tflops * 1e12 / flops_per_token
    bytes_per_token = len(layer_ids) * int(text.hidden_size) * DTYPES[args.dtype].itemsize
    return {
        "model_config": str(args.model_config), "hidden": int(text.hidden_size), "layer_ids": layer_ids,
        "layers_run": layers_run, "sequence_tokens": args.tokens, "flops_per_token": flops_per_token,
        "mfu": args.mfu, "peak_tflops": args.peak_tflops, "tokens_per_s": tokens_per_s,
        "bytes_per_token": bytes_per_token, "gbps": tokens_per_s * bytes_per_token / 1e9,
    }


def machine() -> str:
    cores = os.cpu_count() or 0
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cores}-core {name}"


def report(args: argparse.Namespace, path: HostPath, times: dict[str, list[float]], gpu: dict[str, Any]) -> dict:
    median = {form: statistics.median(values) for form, values in times.items()}
    gbps = {form: path.nbytes / seconds / 1e9 for form, seconds in median.items()}
    connector_gbps = path.nbytes / statistics.median(path.connector_s) / 1e9
    figures = {
        "date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
        "device": torch.cuda.get_device_name(path.device) if path.device.type == "cuda" else "cpu",
        "copy_gbps": gbps["copy"],
        "engines": {
            engine: {"gbps": gbps[engine], "of_copy": gbps[engine] / gbps["copy"],
                     "of_gpu_state_rate": gbps[engine] / gpu["gbps"], "median_s": median[engine]}
            for engine in ENGINES
        },
        "connector_gbps": connector_gbps,
        "gpu_state_rate": gpu,
        "machine": machine(),
        "load_average": list(os.getloadavg()),
        "command": "tools/bench_host_path.py " + " ".join(sys.argv[1:]),
        "shape": {"tokens": args.tokens, "layers": args.layers, "hidden": args.hidden, "dtype": args.dtype},
        "sample_bytes": path.nbytes,
        "repeats": args.repeats,
        "seconds": {**times, "connector": path.connector_s},
    }
    print(
        f"host path: {args.tokens} tokens x {args.layers} layers x {args.hidden} hidden {args.dtype} = "
        f"{path.nbytes / 1e6:.1f} MB per sample on {figures['device']}, {args.repeats} rounds (median), "
        f"load average {figures['load_average'][0]:.2f}"
    )
    print(f"copy into mapped memory: {gbps['copy']:.2f} GB/s")
    for engine in ENGINES:
        entry = figures["engines"][engine]
        verdict = "keeps up with one GPU" if entry["of_gpu_state_rate"] >= 1 else "slower than one GPU makes states"
        print(f"{engine}: {entry['gbps']:.2f} GB/s, {entry['of_copy']:.2f} of the copy, "
              f"{entry['of_gpu_state_rate']:.2f}x one GPU's state rate ({verdict})")
    print(f"  of which the connector (vLLM's process: gather, statistics, transfer file): {connector_gbps:.2f} GB/s")
    print(
        f"one GPU's state rate: {gpu['gbps']:.3f} GB/s = {gpu['tokens_per_s']:,.0f} tokens/s x "
        f"{gpu['bytes_per_token']:,} bytes ({len(gpu['layer_ids'])} layers x hidden {gpu['hidden']} {args.dtype}); "
        f"tokens/s = {gpu['mfu']:g} x {gpu['peak_tflops']:g} TFLOP/s / {gpu['flops_per_token'] / 1e9:.1f} GFLOP per "
        f"token ({gpu['model_config']}, layers 0-{gpu['layers_run'] - 1} of a {gpu['sequence_tokens']}-token sequence)"
    )
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    gpu = gpu_state_rate(args)
    transfer = transfer_dir()
    with tempfile.TemporaryDirectory(prefix="dfq-bench-shard-") as work:
        try:
            path = HostPath(args, Path(work), transfer)
            try:
                figures = report(args, path, measure(path, args.repeats), gpu)
            finally:
                path.sender.close()
        finally:
            for leftover in transfer.iterdir():
                leftover.unlink()
            transfer.rmdir()
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
