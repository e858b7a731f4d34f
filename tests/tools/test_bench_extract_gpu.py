"""The GPU extraction benchmark, run in its tiny CPU mode: it runs, and its report parses."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
NUMBER = r"[\d.e+-]+"
RATE = re.compile(
    rf"^(engine|naive): (?P<tokens>{NUMBER}) tokens/s, (?P<tflops>{NUMBER}) TFLOP/s, MFU (?P<mfu>{NUMBER}) "
    rf"\((?P<s>{NUMBER}) s\)$",
    re.M,
)
BENCH = ["tools/bench_extract_gpu.py", "--size", "tiny", "--device", "cpu", "--samples", "12", "--threads", "1"]


def test_tiny_cpu_run_prints_rates_mfu_and_matches_the_naive_loop():
    done = subprocess.run(
        [sys.executable, *BENCH],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    rates = {m.group(1): m for m in RATE.finditer(out)}
    assert set(rates) == {"engine", "naive"}, out
    useful = float(re.search(r"useful work ([\d.e+-]+) TFLOP", out).group(1))
    for m in rates.values():
        tokens_per_s, tflops, mfu, seconds = (float(m.group(k)) for k in ("tokens", "tflops", "mfu", "s"))
        assert tokens_per_s > 0 and seconds > 0
        assert abs(tflops - useful / seconds) <= 0.01 * tflops
        assert abs(mfu - tflops / 790.0) <= 0.01 * mfu
    tokens = int(re.search(r"workload: 12 sequences, (\d+) tokens", out).group(1))
    assert abs(float(rates["engine"].group("tokens")) * float(rates["engine"].group("s")) - tokens) <= 0.01 * tokens
    assert re.search(r"^speedup engine/naive: [\d.]+x$", out, re.M), out
    diff = float(re.search(r"max \|engine - naive\| ([\d.e+-]+)", out).group(1))
    assert diff < 1e-4  # float32 on the CPU: the packed engine computes what the padded loop does
    canary = re.search(
        r"^canary: a sample alone \(\+ compare\) costs ([\d.]+)x .* worst relative error ([\d.e+-]+)\); "
        r"canaries of at most the median length run ([\d.]+)x the mean sample; "
        r"1 per 256-sample shard = ([\d.]+) of the shard's extract time \(target <= 0\.00391\)$",
        out,
        re.M,
    )
    assert canary, out
    ratio, error, length, share = (float(canary.group(i)) for i in (1, 2, 3, 4))
    assert error < 1e-4 and 0 < length < 1 and abs(share - ratio * length / 256) <= 1e-5 + 0.01 * share
