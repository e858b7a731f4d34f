"""The host path of one sample's hidden states, engine to stored shard, against a plain copy of the same bytes.

One sample of the given shape ([tokens, layers, hidden] in --dtype, on --device) goes, in each round, through:

* copy:         the same bytes copied once into new host memory (on CUDA: device to pinned host memory), the floor
                of any hand-over;
* transformers: the Transformers engine's hand-over (engines/hf_extract.py): `finish_pass` reduces the token
                statistics on the states' device (and on CUDA copies states and statistics to pinned host memory
                on a side stream), `hand_over` checks the statistics and summarises them, and the real shard
                writer stores the states in a local shard file (`TrainingShardWriter.write` + `finish`);
* vllm:         the vLLM engine's hand-over from the connector's transfer file (engines/vllm_states_file.py: states,
                token ids and the statistics the connector computed before its copy to the host, in a tmpfs):
                the worker's `receive_states` (mapped, checked from the token ids and statistics), the finiteness
                check and summary `capture` makes, and the same writer. Making the file is timed apart
                (`connector`: statistics + file write, as the connector's CPU path does).

The forms run in turn within each round (the order rotates), so load from other processes falls on all of them;
each figure is the median over the rounds, and each engine's ratio is its GB/s over the copy's (target >= 0.5).

    tools/bench_host_path.py [--device cpu|cuda] [--tokens 2000] [--layers 5] [--hidden 5120] [--dtype bfloat16]
                             [--repeats N] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_queue.engines.base import CapturedStates, ExtractionRequest  # noqa: E402
from dflash_queue.engines.hf_extract import finish_pass, hand_over  # noqa: E402
from dflash_queue.engines.passes import all_finite, summarize, token_stats  # noqa: E402
from dflash_queue.engines.vllm_states_file import receive_states, save_states  # noqa: E402
from dflash_queue.shards.training import ShardInfo  # noqa: E402
from dflash_queue.shards.training_writer import ShardRow, TrainingShardWriter  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
TARGET_RATIO = 0.5
FORMS = ("copy", "transformers", "vllm")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--tokens", type=int, default=2000)
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=5120)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--repeats", type=int, default=5, help="rounds of every form (median reported)")
    parser.add_argument("--json", type=Path, help="write the figures to this file")
    return parser


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = build_parser()
    args = parser.parse_args(argv)
    if min(args.tokens, args.layers, args.hidden, args.repeats) < 1:
        parser.error("--tokens, --layers, --hidden and --repeats must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch sees no CUDA device")
    return args


def transfer_dir() -> Path:
    """A tmpfs like the engine's transfer directory (/dev/shm), else the temporary directory."""
    shm = Path("/dev/shm")
    base = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return Path(tempfile.mkdtemp(prefix="dfq-bench-host-", dir=base))


class HostPath:
    """One sample's states and what each form needs to hand them over."""

    def __init__(self, args: argparse.Namespace, work: Path, transfer: Path) -> None:
        self.device = torch.device(args.device)
        self.dtype = DTYPES[args.dtype]
        shape = (args.tokens, args.layers, args.hidden)
        generator = torch.Generator().manual_seed(0)
        self.states = torch.randn(shape, generator=generator).to(self.dtype).to(self.device)
        self.nbytes = self.states.numel() * self.states.element_size()
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
        if self.device.type == "cuda":
            host = torch.empty(self.states.shape, dtype=self.dtype, pin_memory=True)
            host.copy_(self.states)
        else:
            torch.empty_like(self.states).copy_(self.states)

    def _store(self, captured: CapturedStates) -> None:
        """The stored local shard (removed after each timed round, `tidy`)."""
        with TrainingShardWriter(self.shard, [self.row], self.info) as writer:
            writer.write(0, captured.states, captured.summary)
            writer.finish()

    def tidy(self) -> None:
        self.shard.unlink(missing_ok=True)

    def transformers(self) -> None:
        result = finish_pass([0], [(0, self.states.shape[0])], self.states, self.copy_stream)
        delivered: dict[int, CapturedStates] = {}
        nonfinite: list[str] = []
        hand_over(result, [self.request], delivered.__setitem__, nonfinite)
        assert not nonfinite, "random states cannot be non-finite"
        self._store(delivered[0])

    def connector_file(self) -> Path:
        """The transfer file as the connector writes it: statistics where the states are, then the host copy, then
        the file (timed apart: the connector's cost, in vLLM's process)."""
        self._file += 1
        path = self.transfer / f"c{self._file}.safetensors"
        started = time.perf_counter()
        stats = token_stats(self.states)
        states, stats = self.states.cpu(), stats.cpu()
        save_states(f"{path}.partial", states, self.ids.to(torch.int64), stats)
        os.replace(f"{path}.partial", path)
        self.connector_s.append(time.perf_counter() - started)
        return path

    def vllm(self, path: Path) -> None:
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
    for form in FORMS:  # a first, untimed round: allocator caches, page cache, kernels
        run(path, form)
        path.tidy()
    path.connector_s.clear()
    for number in range(repeats):
        order = FORMS[number % len(FORMS):] + FORMS[: number % len(FORMS)]
        for form in order:
            if form == "vllm":
                transfer = path.connector_file()
                times[form].append(timed(lambda transfer=transfer: path.vllm(transfer), path.device))
            else:
                times[form].append(timed(lambda form=form: run(path, form), path.device))
            path.tidy()
    return times


def run(path: HostPath, form: str) -> None:
    if form == "vllm":
        path.vllm(path.connector_file())
    else:
        getattr(path, form)()


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


def report(args: argparse.Namespace, path: HostPath, times: dict[str, list[float]]) -> dict:
    median = {form: statistics.median(values) for form, values in times.items()}
    gbps = {form: path.nbytes / seconds / 1e9 for form, seconds in median.items()}
    figures = {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "machine": machine(),
        "device": torch.cuda.get_device_name(path.device) if path.device.type == "cuda" else "cpu",
        "load_average": list(os.getloadavg()),
        "command": "tools/bench_host_path.py " + " ".join(sys.argv[1:]),
        "shape": {"tokens": args.tokens, "layers": args.layers, "hidden": args.hidden, "dtype": args.dtype},
        "sample_bytes": path.nbytes,
        "repeats": args.repeats,
        "copy_gbps": gbps["copy"],
        "target_ratio": TARGET_RATIO,
        "engines": {
            engine: {"gbps": gbps[engine], "ratio": gbps[engine] / gbps["copy"], "median_s": median[engine],
                     "seconds": times[engine]}
            for engine in ("transformers", "vllm")
        },
        "copy_seconds": times["copy"],
        "connector_gbps": path.nbytes / statistics.median(path.connector_s) / 1e9,
    }
    print(
        f"host path: {args.tokens} tokens x {args.layers} layers x {args.hidden} hidden {args.dtype} = "
        f"{path.nbytes / 1e6:.1f} MB per sample on {figures['device']}, {args.repeats} rounds (median), "
        f"load average {figures['load_average'][0]:.2f}"
    )
    print(f"copy: {gbps['copy']:.2f} GB/s")
    for engine in ("transformers", "vllm"):
        entry = figures["engines"][engine]
        verdict = "ok" if entry["ratio"] >= TARGET_RATIO else f"below the target of {TARGET_RATIO}"
        print(f"{engine}: {entry['gbps']:.2f} GB/s, ratio {entry['ratio']:.2f} of a copy ({verdict})")
    print(f"connector (vLLM's process: statistics + transfer file): {figures['connector_gbps']:.2f} GB/s")
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    transfer = transfer_dir()
    with tempfile.TemporaryDirectory(prefix="dfq-bench-shard-") as work:
        try:
            path = HostPath(args, Path(work), transfer)
            figures = report(args, path, measure(path, args.repeats))
        finally:
            for leftover in transfer.iterdir():
                leftover.unlink()
            transfer.rmdir()
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
