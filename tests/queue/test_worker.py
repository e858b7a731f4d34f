"""Worker start-up: how many tasks a lane runs at once; with S3 storage, the start-up storage check and warm
shutdown with uploads in flight (real `dflash-queue worker` subprocesses, redis-server, loopback S3)."""

from __future__ import annotations

import os
import socket
import time
from dataclasses import replace
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from dflash_queue.cli import main
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.lanes.generate import GenerateLane, build_generate_engine, generate_lane_settings
from dflash_queue.lanes.registry import EXTRACT, GENERATE
from dflash_queue.queue.app import configure_app
from dflash_queue.queue.heartbeat import Heartbeat
from dflash_queue.queue.liveness import Incarnation, Liveness
from dflash_queue.queue.tasks import LANE_TASKS
from dflash_queue.runstate.ledger import DONE, Ledger
from dflash_queue.shards.keys import prompts_key, shard_key
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage
from dfq_testing.configs import tiny_vllm_overrides
from dfq_testing.gpus import fake_nvidia_smi
from dfq_testing.pipeline_shards import FLAG_EVERYTHING
from dfq_testing.polling import wait_for_states

REPO = Path(__file__).resolve().parents[2]


def test_the_vllm_lane_runs_its_configured_tasks_in_flight(make_config):
    vllm = make_config("vllm.toml", **tiny_vllm_overrides(inflight_tasks=4))
    transformers = make_config("hf.toml")
    assert GENERATE.default_slots(vllm) == 4
    assert GENERATE.default_slots(transformers) == 1
    # Extract: one slot computing while up to max_pending wait for their uploads.
    assert EXTRACT.default_slots(vllm) == 1 + vllm.storage.uploader.max_pending


def test_a_warning_when_the_other_tasks_cannot_fill_the_engine(make_config):
    config = make_config(**tiny_vllm_overrides(max_num_seqs=32), dataset={"shard_size": 8})
    assert GENERATE.startup_warnings(config, 5) == []  # 4 other tasks hold 32 requests
    [warning] = GENERATE.startup_warnings(config, 2)
    assert "fewer than generate.vllm.max_num_seqs (32)" in warning
    assert EXTRACT.startup_warnings(config, 1) == []


def test_a_vllm_lane_worker_refuses_a_gpu_group_of_another_size(make_config, monkeypatch):
    from click.testing import CliRunner

    from dflash_queue.cli import main

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # restored after: the command sets it
    config = make_config(extract={"engine": "vllm"}, **{"extract.vllm": {"tensor_parallel_size": 2}})
    # 0-3 is GPUs 0 to 3: four, not the two the engine spans.
    result = CliRunner().invoke(main, ["worker", "extract", "-c", config.source, "--gpus", "0-3"])
    assert result.exit_code == 2
    assert "extract GPU group 0,1,2,3 has 4 GPU(s) but extract.vllm.tensor_parallel_size is 2" in result.output
    generate = make_config("generate.toml", **tiny_vllm_overrides())
    result = CliRunner().invoke(main, ["worker", "generate", "-c", generate.source, "--gpus", "0,1"])
    assert result.exit_code == 2 and "generate.vllm.tensor_parallel_size is 1" in result.output


def test_a_worker_refuses_gpus_the_node_does_not_have(make_config, monkeypatch, tmp_path):
    import os

    from click.testing import CliRunner

    from dflash_queue.cli import main
    from dfq_testing.gpus import fake_nvidia_smi

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    config = make_config(extract={"engine": "vllm"}, **{"extract.vllm": {"tensor_parallel_size": 4}})
    # This machine has no GPU: said so.
    result = CliRunner().invoke(main, ["worker", "extract", "-c", config.source, "--gpus", "0-3"])
    assert result.exit_code == 2 and "this node has no GPU" in result.output, result.output
    # A node whose nvidia-smi lists two GPUs: 2 and 3 are not there.
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'bin', 2)}{os.pathsep}{os.environ['PATH']}")
    result = CliRunner().invoke(main, ["worker", "extract", "-c", config.source, "--gpus", "0-3"])
    assert result.exit_code == 2
    assert "GPU 2, 3 not on this node: it has 2 (GPUs 0-1, from nvidia-smi)" in result.output


def test_worker_refuses_to_start_when_the_bucket_is_missing(make_config, s3_tables, start_worker):
    tables = {**s3_tables, "storage": {"url": "s3://bucket-nobody-made/run"}}
    config = make_config(**tables)
    worker = start_worker(config, "extract", wait=False)
    assert worker.process.wait(timeout=300) != 0
    log = worker.log_tail(6000)
    assert "storage check failed for s3://bucket-nobody-made/run/" in log
    assert "'bucket-nobody-made' does not exist at http://127.0.0.1:" in log


def test_worker_refuses_to_start_without_credentials(make_config, s3_tables, start_worker, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    worker = start_worker(make_config(**s3_tables), "generate", wait=False)
    assert worker.process.wait(timeout=300) != 0
    log = worker.log_tail(6000)
    assert "credentials" in log and "FAIL" in log and "AWS_ACCESS_KEY_ID" in log


def test_warm_shutdown_stores_or_requeues_every_shard(make_config, s3_tables, start_worker, redis_url, tmp_path):
    config = make_config(**s3_tables, **{"generate.sampling": {"max_tokens": 12}}, quality=FLAG_EVERYTHING)
    configure_app(config)
    storage = open_storage(config.storage)
    samples = [s for s in read_dataset([REPO / "examples" / "sharegpt_sample.jsonl"], max_record_bytes=1 << 20)
               if isinstance(s, Sample)][:32]
    generate = GenerateLane(generate_lane_settings(config), build_generate_engine(config), storage)
    shard_ids = []
    for begin in range(0, len(samples), 4):
        shard = samples[begin : begin + 4]
        shard_id = prompt_shard_id(shard)
        storage.write_bytes(prompts_key(shard_id), encode_prompts(shard))
        generate.run(shard_id)
        shard_ids.append(shard_id)
    generate.close()

    ledger = Ledger.from_url(redis_url, config.run.name)
    worker = start_worker(config, "extract")
    for shard_id in shard_ids:
        LANE_TASKS["extract"].apply_async(args=(shard_id, 4, config.fingerprint()), queue=EXTRACT.queue)
    # Stop as soon as the first shard is done, while the others are queued, computing or uploading.
    deadline = time.monotonic() + 300
    while DONE not in ledger.states(shard_ids).values():
        assert worker.alive() and time.monotonic() < deadline, worker.log_tail()
        time.sleep(0.05)
    worker.terminate()
    assert worker.process.wait(timeout=300) == 0, worker.log_tail()

    # Every shard is either stored and done, or its message is back in the queue; nothing is left unacked.
    broker = redis.Redis.from_url(redis_url)
    done = {s for s, state in ledger.states(shard_ids).items() if state == DONE}
    for shard_id in done:
        with storage.local_copy(shard_key(shard_id)) as path:
            assert len(TrainingShard(path)) == 4
    assert broker.llen(EXTRACT.queue) == len(shard_ids) - len(done), worker.log_tail()
    assert broker.hlen("unacked") == 0
    assert list(config.staging_dir.glob("*/*")) == []
    assert storage.incomplete_uploads() == []

    # A new worker finishes the rest.
    again = start_worker(config, "extract")
    wait_for_states(ledger, shard_ids, {DONE}, timeout=600, workers=[again])
    assert sorted(k.split("/")[1].split(".")[0] for k in storage.list("shards/")) == sorted(shard_ids)


def test_a_worker_given_gpus_is_named_for_them_and_refused_beside_a_live_namesake(
    make_config, redis_url, monkeypatch, tmp_path
):
    """The default node name carries the GPU group (from --gpus, or CUDA_VISIBLE_DEVICES as the environment sets it);
    a worker whose name a live worker holds (a fresh heartbeat, its process in another container's pid namespace)
    stops before it loads anything, naming that worker."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # restored after: the command sets it
    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path / 'bin', 4)}{os.pathsep}{os.environ['PATH']}")
    # A worker let past the refusal would go on to load its engine and consume in this process: it stops here.
    monkeypatch.setattr(Heartbeat, "succeed_predecessors", lambda self: pytest.fail(f"{self.node} was not refused"))
    config = make_config()
    liveness = Liveness(redis.Redis.from_url(redis_url, decode_responses=True), config.run.name, ttl_s=30)
    here = Incarnation.of_this_process("")
    named = [(None, None, ""), ("0,1", None, "-gpu0-1"), (None, "2,3", "-gpu2-3"),
             (None, "GPU-8f0e2c1a,GPU-77b1", "-gpuGPU-8f0e2c1a_GPU-77b1")]
    for gpus, environment, label in named:
        node = f"generate-{config.run.name}{label}@{socket.gethostname()}"
        namesake = replace(here, id=f"namesake{label}", node=node,
                           process=replace(here.process, pid_namespace="pid:[4026530000]"))
        liveness.register(namesake)
        if environment is not None:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", environment)
        result = CliRunner().invoke(main, ["worker", "generate", "-c", config.source,
                                           *(["--gpus", gpus] if gpus else [])])
        assert isinstance(result.exception, SystemExit) and result.exit_code == 1, result.output
        assert f"node name {node} is in use by a live worker of run {config.run.name}" in result.output
        assert "incarnation namesake" in result.output and "another pid namespace" in result.output
        assert liveness.live_namesakes(replace(namesake, id="other")) == [namesake]
