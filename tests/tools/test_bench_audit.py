"""The audit benchmark in its quick mode on the trained checkpoint: real extract and audit workers with the audit off
and on, the audit's own rate and the load check's figures at the seed target's size, its printout and JSON in
agreement."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent.parent


def test_the_quick_run_measures_the_lane_with_and_without_the_audit_and_the_load_check(trained_model, tmp_path):
    out = tmp_path / "audit.json"
    done = subprocess.run(
        [sys.executable, "tools/bench_audit.py", "--quick", "--model", str(trained_model), "--every-shards", "1",
         "--out", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, timeout=900, cwd=REPO,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-4000:]
    report = json.loads(out.read_text())
    modes = [r["audit"] for r in report["rounds"]]
    assert modes == ["off", "on"]
    off, on = report["rounds"]
    assert off["extract_tokens"] == on["extract_tokens"] > 0 and off["audit_shards"] == 0
    assert on["audit_shards"] == 2 and on["audit_tokens"] > 0 and report["audit_failed"] == 0
    assert 0 < report["extract_ratio_on_off"] and report["audit_tokens_per_s"] > 0
    check = report["load_check"]
    assert check["target_layers"] == 64 and 20e9 < check["target_layers_params"] < 30e9
    assert set(check["passes"]) == {"float32", "bfloat16"} and check["target_probe_seconds"] > check["probe_seconds"]
    printed = re.search(r"extract lane with the audit on / off: ([\d.]+) of its tokens/s", done.stdout)
    assert printed and float(printed.group(1)) == round(report["extract_ratio_on_off"], 3)
    assert "at qwen3.6-27b-class (64 layers" in done.stdout
