"""The host-path benchmark at a small shape: both engines' forms and the copy run side by side, the report and the
JSON agree, and it runs with none of the packages the GPU machine lacks (no Celery, Redis, vLLM, orjson, pydantic,
click or rich), since the GPU check script calls it there."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent
NUMBER = r"[\d.]+"
# Imports refused in the benchmark's process: what the GPU machine's Python does not have.
ABSENT = ["celery", "kombu", "redis", "boto3", "orjson", "vllm", "pydantic", "click", "rich", "zstandard", "pyarrow"]


def run_bench(*args: str) -> subprocess.CompletedProcess:
    refuse = "; ".join(f"sys.modules[{name!r}] = None" for name in ABSENT)
    code = (
        f"import runpy, sys; {refuse}; sys.argv = ['tools/bench_host_path.py', *{list(args)!r}]; "
        "runpy.run_path('tools/bench_host_path.py', run_name='__main__')"
    )
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=REPO)


def test_a_small_run_reports_each_engine_next_to_a_copy(tmp_path):
    out = tmp_path / "host.json"
    done = run_bench("--tokens", "96", "--layers", "3", "--hidden", "512", "--repeats", "2", "--json", str(out))
    assert done.returncode == 0, done.stderr[-4000:]
    text = done.stdout
    assert re.search(r"^host path: 96 tokens x 3 layers x 512 hidden bfloat16 = 0\.3 MB per sample on cpu, 2 rounds",
                     text, re.M), text
    copy = float(re.search(rf"^copy: ({NUMBER}) GB/s$", text, re.M).group(1))
    figures = json.loads(out.read_text())
    assert figures["sample_bytes"] == 96 * 3 * 512 * 2 and figures["repeats"] == 2
    assert figures["shape"] == {"tokens": 96, "layers": 3, "hidden": 512, "dtype": "bfloat16"}
    assert round(figures["copy_gbps"], 2) == copy and len(figures["copy_seconds"]) == 2
    for engine in ("transformers", "vllm"):
        line = re.search(rf"^{engine}: ({NUMBER}) GB/s, ratio ({NUMBER}) of a copy \((ok|below the target of 0\.5)\)$",
                         text, re.M)
        assert line, text
        entry = figures["engines"][engine]
        assert round(entry["gbps"], 2) == float(line.group(1)) and round(entry["ratio"], 2) == float(line.group(2))
        assert len(entry["seconds"]) == 2 and all(s > 0 for s in entry["seconds"])
        assert abs(entry["ratio"] - entry["gbps"] / figures["copy_gbps"]) < 1e-9
    assert figures["connector_gbps"] > 0 and figures["date"] and figures["machine"]


def test_options_it_cannot_honour_are_refused():
    import torch

    if not torch.cuda.is_available():
        done = run_bench("--device", "cuda")
        assert done.returncode == 2 and "--device cuda: torch sees no CUDA device" in done.stderr
    done = run_bench("--repeats", "0")
    assert done.returncode == 2 and "must be >= 1" in done.stderr
