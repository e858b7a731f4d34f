"""A typo in the served model name refuses `dflash-queue run` after it staged its prompts; the corrected config then
takes the staged-only output over, nothing deleted by hand, and the job ends whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_queue.runstate.run_identity import MANIFEST_KEY, RunIdentity
from dflash_queue.shards.keys import PROMPTS, SHARDS
from dfq_testing.commands import dflash_queue
from dfq_testing.configs import tiny_config_tables, write_config
from dfq_testing.fake_sglang_process import FakeSglangProcess
from dfq_testing.jobs import first_lines

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow


def test_a_served_model_typo_refuses_the_run_and_the_corrected_config_takes_its_staged_prompts_over(
    tiny_model, tmp_path
):
    server = FakeSglangProcess(tiny_model, tmp_path / "fake.log").start()
    tables = tiny_config_tables(tiny_model, tmp_path / "out", "", tmp_path / "state")

    def config(name: str, served: str) -> Path:
        return write_config(
            tmp_path / name, tables, generate={"engine": "server"}, dataset={"shard_size": 4, "max_model_len": 1024},
            **{"generate.server": {"urls": [server.url], "kind": "sglang", "model": served},
               "generate.sampling": {"temperature": 1.0, "max_tokens": 8, "seed": 3}},
        )

    dataset = first_lines(SAMPLE, 8, tmp_path / "prompts.jsonl")
    output = tmp_path / "out"
    try:
        typo = dflash_queue("run", dataset, "-c", config("typo.toml", "tiny-qwen4"), timeout=300)
        assert typo.returncode == 1, typo.stdout + typo.stderr
        error = " ".join(typo.stderr.split())
        # The summary line quotes the worker's error whole, the reason in it, without a stray ":;".
        assert "the generate worker exited with code 1: " in error and ":;" not in error
        assert (f"no inference server can serve tiny-qwen4 (generate.server.urls): {server.url}: serves tiny-qwen3, "
                "not tiny-qwen4 (generate.server.model); log ") in error
        staged = sorted(p.name for p in (output / PROMPTS).iterdir())
        assert len(staged) == 2 and not (output / SHARDS).exists()

        fixed = dflash_queue("run", dataset, "-c", config("fixed.toml", "tiny-qwen3"), timeout=300)
    finally:
        server.kill()
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr[-3000:]
    assert "shards:            2 done, 0 failed" in fixed.stdout
    # run says what it took over, as enqueue does.
    assert "it held staged prompts only (no completion, no training shard)" in fixed.stderr, fixed.stderr[-3000:]
    assert len(list((output / SHARDS).iterdir())) == 2
    assert sorted(p.name for p in (output / PROMPTS).iterdir()) == staged  # nothing deleted
    recorded = RunIdentity.from_json((output / MANIFEST_KEY).read_bytes())
    assert recorded.settings["generate.server.model"] == "tiny-qwen3"
