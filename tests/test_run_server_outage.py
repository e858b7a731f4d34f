"""`dflash-queue run` on the inference-server engine through an outage of its one server (a fake SGLang server as a
process of its own, killed then started again on its port): the run says when generation begins to wait and when
it goes on, `status` gives no countdown meanwhile, and the job ends whole."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dfq_testing.commands import dflash_queue
from dfq_testing.configs import tiny_config_tables, write_config
from dfq_testing.fake_sglang_process import FakeSglangProcess
from dfq_testing.jobs import first_lines
from dfq_testing.polling import wait_until

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow


def test_run_says_when_generation_waits_for_its_servers_and_status_gives_no_countdown(tiny_model, tmp_path):
    server = FakeSglangProcess(tiny_model, tmp_path / "fake.log").start()
    server.set_faults(delay_s=1.0)  # a task is surely in flight when the server dies
    tables = tiny_config_tables(tiny_model, tmp_path / "out", "", tmp_path / "state")
    config = write_config(
        tmp_path / "run.toml", tables,
        generate={"engine": "server"},
        dataset={"shard_size": 4, "max_model_len": 1024},
        **{"generate.server": {"urls": [server.url], "kind": "sglang", "model": "tiny-qwen3",
                               "backoff_initial_s": 0.05, "backoff_max_s": 0.5},
           "generate.sampling": {"temperature": 1.0, "max_tokens": 16, "seed": 3}},
    )
    dataset = first_lines(SAMPLE, 8, tmp_path / "prompts.jsonl")
    stderr = tmp_path / "run.stderr"
    generate_log = tmp_path / "state" / "logs" / "generate.log"
    with open(stderr, "w") as sink:
        run = subprocess.Popen([sys.executable, "-m", "dflash_queue", "run", str(dataset), "-c", str(config)],
                               stdout=subprocess.PIPE, stderr=sink, text=True)
    try:
        def said(words: str) -> bool:
            assert run.poll() is None, stderr.read_text()[-3000:]
            return words in stderr.read_text()

        wait_until(lambda: generate_log.exists() and "Task dfq.generate" in generate_log.read_text(), 120,
                   "a generate task started")
        server.kill()
        wait_until(lambda: said("every inference server is down since"), 30, "run saying generation waits")
        assert server.url in stderr.read_text() and "cannot connect" in stderr.read_text()

        shown = dflash_queue("status", "-c", config, "--timeout", "2", timeout=120)
        text = " ".join(shown.stdout.split())
        assert "every inference server has been down for" in text, shown.stdout + shown.stderr
        assert "run ETA: waiting for servers" in text and "run ETA (the slower lane)" not in text, text
        assert "waiting for servers" in text.split("ETA", 1)[1]  # the lanes' ETA row too

        server = FakeSglangProcess(tiny_model, tmp_path / "fake.log", port=server.port).start()  # back, same URL
        out, _ = run.communicate(timeout=240)
    finally:
        if run.poll() is None:
            run.kill()
            run.communicate()
        server.kill()
    text = stderr.read_text()
    assert run.returncode == 0, text[-3000:]
    assert text.count("every inference server is down since") == 1, text  # said once, not at every poll
    assert text.count("an inference server is back after") == 1, text
    assert text.index("is down since") < text.index("is back after")
    assert "shards:            2 done, 0 failed" in out, out
