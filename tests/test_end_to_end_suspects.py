"""Faults a broken connector or model runner would have, put into vLLM's processes from outside the package
(dfq_testing/connector_faults.py), on the 16-layer family: an engine that reads its deepest layer one token off for
every request is refused at load (its worker exits 78, `status` says why); through `dflash-queue run`, a fault that
only the reference audit sees leaves suspect shards, which `verify`, `export` and the training reader refuse until
`suspects reextract` and a new run store them anew."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_queue.config import load_config
from dflash_queue.runstate.stopped_workers import EXIT_FAILING_CHECKS
from dflash_queue.shards.keys import shard_id_of, shard_key
from dflash_queue.shards.training import TrainingShard
from dflash_queue.training import ShardDataset
from dfq_testing import connector_faults
from dfq_testing.commands import dflash_queue
from dfq_testing.configs import tiny_config_tables, write_config

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
# vLLM extracting the 16-layer family in float32, prefilled in 64-token steps; one shard of 4 samples.
VLLM_EXTRACT = {
    "dataset": {"shard_size": 4, "max_model_len": 500},
    "extract": {"engine": "vllm", "hidden_dtype": "float32"},
    "extract.vllm": {"dtype": "float32", "max_model_len": 512, "max_num_batched_tokens": 64, "max_num_seqs": 8,
                     "enforce_eager": True, "kv_cache_memory_gib": 0.5, "log_stats_interval_s": 0},
}


def test_a_worker_refuses_at_load_an_engine_that_reads_its_deepest_layer_one_token_off(
    tiny_deep_family, tmp_path, redis_url, start_worker
):
    """A `dflash-queue worker extract` on the 16-layer family with vLLM extracting, the deepest captured layer's rows
    one token off for every request (the load check's probes too): it refuses to start, exits 78 (which systemd
    does not restart) saying which layer, and `status` lists it with the reason."""
    model = tiny_deep_family("qwen3", 16)
    config = load_config(write_config(
        tmp_path / "worker.toml", tiny_config_tables(model, tmp_path / "storage", redis_url, tmp_path / "state"),
        **VLLM_EXTRACT,
    ))
    worker = start_worker(config, "extract", wait=False,
                          env=connector_faults.environment([{"kind": "deepest_layer_offset"}]))
    assert worker.process.wait(timeout=600) == EXIT_FAILING_CHECKS, worker.log_tail()
    log = worker.log_tail(200_000)
    assert "ReferenceMismatch: vLLM extract engine: layer 13 (decoder_output) differs from the checkpoint's own" in log
    status = dflash_queue("status", "-c", config.source, "--json", timeout=300)
    assert status.returncode == 0, status.stderr[-2000:]
    [stopped] = json.loads(status.stdout)["stopped_workers"]
    assert stopped["lane"] == "extract" and stopped["exit_status"] == EXIT_FAILING_CHECKS
    assert stopped["reason"].startswith("ReferenceMismatch: vLLM extract engine: layer 13 (decoder_output) differs")


def test_a_fault_only_the_audit_sees_leaves_suspect_shards_that_no_reader_serves_until_extracted_again(
    tiny_deep_family, tmp_path
):
    """`dflash-queue run` on the 16-layer family, vLLM extracting with every dataset sample's rows one slot off past
    40 tokens (the load check's probes and the canary's reruns see the same engine, so neither can tell), the audit on
    every shard: the audit halts the extract worker (exit 78) and makes its shards suspect. `verify` fails naming
    them, `export` refuses them, the training reader leaves them out, `suspects list` lists them; once the engine is
    fixed, `suspects reextract` and a new `run` store them anew, and everything reads as good again."""
    model = tiny_deep_family("qwen3", 16)
    tables = tiny_config_tables(model, tmp_path / "storage", "", tmp_path / "state")
    config = write_config(
        tmp_path / "run.toml", tables, **VLLM_EXTRACT,
        audit={"enabled": True, "every_shards": 1, "samples_per_shard": 4},
    )
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(SAMPLE.read_text().splitlines()[:4]) + "\n")
    command = [sys.executable, "-m", "dflash_queue", "run", str(prompts), "-c", str(config)]
    # Only the dataset's samples (32 hex digits), not the probes: the engine starts, its checks see nothing.
    faulty = connector_faults.environment([{"kind": "slot_offset_after", "position": 40, "samples": "[0-9a-f]{32}"}])
    run = subprocess.run(command, capture_output=True, text=True, timeout=900, env=faulty)
    assert run.returncode != 0, run.stdout[-3000:]
    audit_log = (tmp_path / "state" / "logs" / "audit.log").read_text()
    assert "against the checkpoint's own forward; samples" in audit_log and "shard(s) made suspect" in audit_log
    # The extract worker stops when it sees the halt (tests/queue/test_audit_halt.py), unless the run, every shard
    # extracted, stopped it first: either way every shard it stored since its last passed audit is suspect.
    extract_log = (tmp_path / "state" / "logs" / "extract.log").read_text()
    assert ("stopping this worker: halted by the reference audit: audit of shard" in extract_log
            or "suspect shard " in run.stdout), run.stdout[-3000:]
    listed = dflash_queue("suspects", "list", "-c", config, "--json", timeout=300)
    suspects = {entry["shard"] for entry in json.loads(listed.stdout)}
    stored = {p.stem for p in (tmp_path / "storage" / "shards").glob("*.safetensors")}
    assert suspects and suspects <= stored, listed.stdout + listed.stderr[-2000:]

    verified = dflash_queue("verify", prompts, "-c", config, timeout=300)
    assert verified.returncode == 1 and all(shard in verified.stdout for shard in suspects), verified.stdout
    exported = dflash_queue("export", tmp_path / "storage", "--format", "speculators", tmp_path / "export", timeout=300)
    assert exported.returncode != 0 and all(shard in exported.stdout + exported.stderr for shard in suspects)
    readable = ShardDataset(str(tmp_path / "storage"))  # the training reader: suspect shards left out, named
    assert {shard_id_of(key) for key, _ in readable.suspect_shards} == suspects
    assert len(readable) == sum(len(TrainingShard(tmp_path / "storage" / shard_key(s))) for s in stored - suspects)

    # The engine fixed (no fault): one command sends the suspect shards back to the extract lane, a run stores them.
    sent = dflash_queue("suspects", "reextract", "-c", config, timeout=300)
    assert sent.returncode == 0, sent.stdout + sent.stderr[-2000:]
    rerun = subprocess.run(command, capture_output=True, text=True, timeout=900)
    assert rerun.returncode == 0, rerun.stdout[-3000:] + rerun.stderr[-3000:]
    assert "audit:" in rerun.stdout and "all agree" in rerun.stdout.split("audit:", 1)[1].splitlines()[0]
    assert json.loads(dflash_queue("suspects", "list", "-c", config, "--json", timeout=300).stdout) == []
    assert dflash_queue("verify", prompts, "-c", config, timeout=300).returncode == 0
    assert not list((tmp_path / "storage" / "suspect").rglob("*.json"))
