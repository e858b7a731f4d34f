"""The two-engine extract benchmark in its quick mode on the CPU (vLLM's CPU build): both engines run, each in a
process of its own, and the report parses and adds up. One round runs here (each round starts both engines again,
vLLM's in three processes); the order of later rounds is checked on its own. (tests/tools/test_gpu_check.py runs
the GPU check script that drives it.)"""

from __future__ import annotations

import importlib.util
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
NUMBER = r"[\d.]+"
RUN = re.compile(
    rf"^(?P<engine>transformers|vllm): (?P<rate>{NUMBER}) tokens/s \((?P<tokens>\d+) tokens in (?P<s>{NUMBER}) s\), "
    rf"peak host memory (?P<peak>{NUMBER}) GiB \(round (?P<round>\d)\)$",
    re.M,
)
CANARY = re.compile(
    rf"^canary: (transformers|vllm) a sample alone costs ({NUMBER})x the batched time per token \((\d+) samples, "
    rf"(\d+) tokens in ({NUMBER}) s\); at 1 per 8-sample shard = ({NUMBER}) of the shard's extract time "
    rf"\(round (\d)\)$",
    re.M,
)
ROUND = re.compile(rf"^round (\d): ratio vllm/transformers ({NUMBER}) x \((\w+) first; load average", re.M)
MEDIAN = re.compile(rf"^(transformers|vllm): median ({NUMBER}) tokens/s over 1 round, peak host memory ({NUMBER}) "
                    r"GiB \(largest\), load [\d.]+ s, \d+ task slots, mode (\w+)$", re.M)


def close(a: float, b: float, rel: float = 1e-3, absolute: float = 0.0) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b)) + absolute


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_extract", REPO / "tools" / "bench_extract.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_rounds_alternate_which_engine_goes_first(bench):
    engines = ["transformers", "vllm"]
    assert [bench.engine_order(engines, n) for n in (1, 2, 3, 4)] == [
        ["transformers", "vllm"], ["vllm", "transformers"], ["transformers", "vllm"], ["vllm", "transformers"]
    ]
    assert bench.engine_order(["vllm"], 2) == ["vllm"]
    assert engines == ["transformers", "vllm"]  # the caller's list is left as it was


@pytest.mark.slow
@pytest.mark.vllm
def test_quick_run_reports_both_engines_side_by_side(tiny_family, tmp_path):
    model = tiny_family("qwen3")
    done = subprocess.run(
        [sys.executable, "tools/bench_extract.py", "--quick", "--model", str(model), "--out", str(tmp_path / "work"),
         "--rounds", "1", "--json"],
        capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    text, report = done.stderr, json.loads(done.stdout)  # --json: the text report goes to stderr

    baseline = float(re.search(rf"^parent: host memory ({NUMBER}) GiB \(baseline", text, re.M).group(1))
    runs = list(RUN.finditer(text))
    assert [(m["engine"], m["round"]) for m in runs] == [("transformers", "1"), ("vllm", "1")], text
    rates: dict[str, list[float]] = {"transformers": [], "vllm": []}
    for m in runs:
        rate, tokens, seconds, peak = float(m["rate"]), int(m["tokens"]), float(m["s"]), float(m["peak"])
        assert rate > 0 and tokens > 0 and seconds > 0
        assert close(rate, tokens / seconds, absolute=0.05)
        # The engine's process tree, above what this bench's own process held before loading anything.
        assert peak > baseline > 0
        rates[m["engine"]].append(rate)
    # The same shards: the same tokens for each engine in each round.
    assert len({m["tokens"] for m in runs}) == 1
    peaks = {(m["engine"], m["round"]): float(m["peak"]) for m in runs}
    # vLLM's engine runs in processes of its own besides the one that drives it: they are counted.
    assert peaks[("vllm", "1")] > peaks[("transformers", "1")] + 0.2

    rounds = ROUND.findall(text)
    assert [(n, first) for n, _, first in rounds] == [("1", "transformers")]
    for (number, ratio, _), v, t in zip(rounds, rates["vllm"], rates["transformers"]):
        assert close(float(ratio), v / t, rel=2e-3, absolute=5e-4), number

    medians = {engine: (float(rate), float(peak), mode) for engine, rate, peak, mode in MEDIAN.findall(text)}
    assert medians["transformers"][2] == "packed" and medians["vllm"][2] == "vllm"
    for engine, (median, peak, _) in medians.items():
        assert close(median, statistics.median(rates[engine]), absolute=0.1)
        assert peak == max(p for (e, _), p in peaks.items() if e == engine)
    ratio = float(re.search(rf"^ratio vllm/transformers: ({NUMBER}) x \(median of 1 round\)$", text, re.M).group(1))
    assert close(ratio, medians["vllm"][0] / medians["transformers"][0], rel=2e-3, absolute=5e-4)

    canaries = CANARY.findall(text)
    assert sorted((engine, number) for engine, *_, number in canaries) == [("transformers", "1"), ("vllm", "1")]
    for _, cost, samples, tokens, seconds, share, _ in canaries:
        assert float(cost) > 0 and int(samples) > 0 and int(tokens) > 0 and float(seconds) > 0 and float(share) > 0

    worst, samples = re.search(
        r"^agreement: worst relative error ([\d.e+-]+) \(vllm vs transformers, per layer, over (\d+) samples, "
        r"float32\)$", text, re.M
    ).groups()
    # Two engines, two implementations: not bit-identical, and equal to float32's rounding.
    assert 0 < float(worst) <= 1e-5
    assert int(samples) == 2 * 8 + 2  # the measured shards and the warm-up shard

    assert close(report["ratio"], ratio, rel=2e-3, absolute=5e-4)  # the text prints 3 decimals
    assert f"{report['agreement']['worst_relative_error']:.3e}" == worst
    for engine in ("transformers", "vllm"):
        assert close(report["engines"][engine]["median_tokens_per_s"], medians[engine][0], absolute=0.1)
        assert [run["round"] for run in report["engines"][engine]["runs"]] == [1]
    assert report["baseline_bytes"] > 0 and report["settings"]["shard_size"] == 8

    # MFU from the shapes: the same useful work for both engines (vLLM runs every layer; the Transformers engine
    # drops those above the highest captured one), over each run's own time; as the GPU check's report reads it.
    spec = importlib.util.spec_from_file_location("gpu_check_report", REPO / "tools" / "gpu_check_report.py")
    report_tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(report_tool)
    for engine in ("transformers", "vllm"):
        figures = report_tool.engine_figures(report, engine)
        for key in ("tokens_per_s", "mfu", "tflops", "flops_per_token", "canary_share"):
            assert figures[key] > 0, (engine, key)
        for run in report["engines"][engine]["runs"]:
            assert close(run["mfu"], run["flops"] / run["seconds"] / 1e12 / 790.0)
    assert report["engines"]["vllm"]["layers_run"] == 6 and report["engines"]["transformers"]["layers_run"] == 4
    assert report["engines"]["transformers"]["engine_alone"]["median_tokens_per_s"] > 0
