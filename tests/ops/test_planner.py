"""Planner arithmetic against hand-computed cases, and prompt counting with the real tokenizer."""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from dflash_queue.data.chat_template import ChatFormatter
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.ops.planner import (
    PromptStats,
    count_prompts,
    hidden_state_bytes,
    measured_from_counters,
    policy_output_tokens,
    reservoir,
    schedule,
)
from dflash_queue.runstate.ledger import Ledger
from dfq_testing.commands import dflash_queue

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
DAY = 86400


def test_the_days_a_run_takes_at_each_engine_speed():
    # 1M prompts x 1,370 generated tokens = 1.37e9 tokens.
    hf = schedule(1_000_000, 1370, 160, gpus=1)
    assert hf.tokens == 1.37e9
    assert hf.wall_s == pytest.approx(1.37e9 / 160)  # 8,562,500 s
    assert hf.wall_s / DAY == pytest.approx(99.10, abs=0.01)
    assert hf.gpu_hours == pytest.approx(2378.47, abs=0.01)
    batched = schedule(1_000_000, 1370, 1200, gpus=1)
    assert batched.wall_s / DAY == pytest.approx(13.21, abs=0.01)
    subset = schedule(300_000, 1370, 1200, gpus=1)
    assert subset.wall_s / DAY == pytest.approx(3.96, abs=0.01)

    # 8 GPUs as 4 tensor-parallel pairs at 2,000 tok/s per pair: 1.37e9 / 8,000 s; GPU-hours count both GPUs.
    tp = schedule(1_000_000, 1370, 2000, gpus=8, gpus_per_worker=2)
    assert tp.wall_s == pytest.approx(171_250.0)
    assert tp.gpu_hours == pytest.approx(1.37e9 / 2000 * 2 / 3600)
    with pytest.raises(ValueError, match="do not split"):
        schedule(10, 10, 10, gpus=3, gpus_per_worker=2)
    with pytest.raises(ValueError, match="positive"):
        schedule(10, 10, 0, gpus=1)


def test_hidden_state_storage():
    # 800K samples x 3K tokens, K=5, hidden 5120: 2.4e9 x 51,200 B = 122.88 TB in bf16, half in fp8.
    assert hidden_state_bytes(2.4e9, 5, 5120, 2) == pytest.approx(122.88e12)
    assert hidden_state_bytes(2.4e9, 5, 5120, 1) == pytest.approx(61.44e12)
    assert hidden_state_bytes(1, 1, 10, 2) == 20


def test_shard_size_and_extract_worker_memory_at_the_target_shape():
    from dflash_queue.ops.shard_sizing import shard_bytes, task_host_bytes

    # 256 samples x 1,750 tokens, K=5, hidden 5120: per token 51,200 B of bf16 states + 4 B id + 1 B mask.
    assert shard_bytes(256, 1750, 5, 5120, "bfloat16") == 256 * 1750 * 51_205 + 8 * 257  # 22.9 GB
    assert shard_bytes(256, 1750, 5, 5120, "fp8_e4m3") == 256 * 1750 * (25_600 + 5 + 20) + 8 * 257
    # Two passes of 16,384 tokens in bf16, one sequence converted, one canary copy: 1.86 GB whatever the shard.
    host = task_host_bytes(token_budget=16384, longest_tokens=1750, num_layers=5, hidden_size=5120, model_bytes=2,
                           hidden_dtype="bfloat16", canary_samples=1)
    assert host == 2 * 16384 * 25_600 * 2 + 1750 * 25_600 * 2 + 1750 * 25_600 * 2
    # A sequence longer than the budget runs alone: the pass is that long; fp8 converts through float32.
    assert task_host_bytes(token_budget=100, longest_tokens=300, num_layers=1, hidden_size=10, model_bytes=4,
                           hidden_dtype="fp8_e4m3", canary_samples=0, activation_bytes=7) == 2 * 300 * 10 * 4 + 300 * 40 + 7


def test_model_shape_of_a_multimodal_checkpoint_counts_the_last_layer_entries(make_config, tiny_family):
    from dflash_queue.ops.planner import model_shape

    config = make_config("q35.toml", model={"path": str(tiny_family("qwen3_5"))}, extract={"num_draft_layers": 3})
    shape = model_shape(config.model, config.extract)
    assert (shape.num_layers_kept, shape.hidden_size) == (3, 64)
    with_norm = make_config("q35n.toml", model={"path": str(tiny_family("qwen3_5"))},
                            extract={"num_draft_layers": 3, "final_norm_state": True})
    assert model_shape(with_norm.model, with_norm.extract).num_layers_kept == 4
    both = make_config("q35b.toml", model={"path": str(tiny_family("qwen3_5"))},
                       extract={"num_draft_layers": 3, "final_norm_state": True, "last_layer_state": True})
    assert model_shape(both.model, both.extract).num_layers_kept == 5  # the last layer before the norm is an entry of its own


def test_output_tokens_from_the_thinking_mix():
    assert policy_output_tokens(1.0, 4096) == 2048
    assert policy_output_tokens(0.0, 4096) == 512
    assert policy_output_tokens(1.0, 1000) == 1000  # capped by max_tokens
    assert policy_output_tokens(0.25, 1024) == pytest.approx(0.25 * 1024 + 0.75 * 512)
    assert policy_output_tokens(0.5, 8192, thinking_tokens=3000, plain_tokens=400) == 1700


def test_standard_error_of_the_extrapolated_total():
    stats = PromptStats(100, 0, 0, 10, 50.0, 20.0, 1.0)
    assert stats.prompt_tokens == 5000
    assert stats.prompt_tokens_se == pytest.approx(100 * 20 / math.sqrt(10) * math.sqrt(90 / 99))  # 603.02
    assert PromptStats(100, 0, 0, 100, 50.0, 20.0, 1.0).prompt_tokens_se == 0  # every prompt tokenised


def test_measured_averages_from_counters():
    run = measured_from_counters({
        "generate_samples": 200, "generate_completion_tokens": 300_000, "generate_busy_ms": 250_000,
        "extract_tokens": 400_000, "extract_busy_ms": 40_000,
    })
    assert run.output_tokens_per_sample == 1500
    assert run.tokens_per_s == {"generate": 1200, "extract": 10_000}
    empty = measured_from_counters({})
    assert empty.output_tokens_per_sample is None and empty.tokens_per_s == {"generate": None, "extract": None}


def test_reservoir_is_a_uniform_sample_of_distinct_items():
    kept, seen = reservoir(iter(range(1000)), 50, random.Random(1))
    assert seen == 1000 and len(set(kept)) == 50
    assert reservoir(iter(range(5)), 50, random.Random(1)) == ([0, 1, 2, 3, 4], 5)
    # Each item is kept with probability 50/1000: over many draws the late items are as likely as early ones.
    late = sum(x >= 500 for _ in range(200) for x in reservoir(iter(range(1000)), 50, random.Random(_))[0])
    assert 0.45 < late / (200 * 50) < 0.55


def exact_prompt_tokens(config, tiny_model) -> list[int]:
    formatter = ChatFormatter(AutoTokenizer.from_pretrained(tiny_model))
    samples = [s for s in read_dataset([SAMPLE], max_record_bytes=1 << 20) if isinstance(s, Sample)]
    thinking = config.dataset.thinking == "always"
    return [len(formatter.prompt_ids(s.messages, enable_thinking=thinking)) for s in samples]


def test_counting_prompts_with_the_real_tokenizer(make_config, tiny_model):
    config = make_config()
    exact = exact_prompt_tokens(config, tiny_model)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)

    whole = count_prompts(config.dataset, config.model, [SAMPLE], tokenizer, sample_size=1000)
    assert whole.prompts == len(exact) == 50 and whole.sample_size == 50
    assert whole.prompt_tokens == pytest.approx(sum(exact)) and whole.prompt_tokens_se == 0
    assert whole.thinking_share == 1.0

    sampled = count_prompts(config.dataset, config.model, [SAMPLE], tokenizer, sample_size=20, seed=3)
    assert sampled.sample_size == 20 and sampled.prompt_tokens_se > 0
    assert abs(sampled.prompt_tokens - sum(exact)) < 4 * sampled.prompt_tokens_se


def plan_json(config, *args) -> dict:
    result = dflash_queue("plan", SAMPLE, "-c", config.source, "--json", *args, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def test_plan_command_end_to_end(make_config, tiny_model):
    config = make_config(**{"generate.sampling": {"max_tokens": 48}})
    plan = plan_json(config, "--gpus", "2", "--tokens-per-second", "160", "--tokens-per-second", "1200",
                     "--subset", "300000", "--sample-size", "1000")
    exact = sum(exact_prompt_tokens(config, tiny_model))
    assert plan["prompts"] == 50 and plan["prompt_tokens"]["total"] == pytest.approx(exact)
    assert plan["output_tokens"]["per_prompt"] == 48  # thinking always: 2,048 capped at max_tokens 48
    assert plan["hidden_states"]["layers"] == 3 and plan["hidden_states"]["hidden_size"] == 128
    tokens = 50 * (exact / 50 + 48)
    assert plan["hidden_states"]["bf16_bytes"] == pytest.approx(tokens * 3 * 128 * 2)
    assert plan["hidden_states"]["fp8_bytes"] == pytest.approx(tokens * 3 * 128)
    assert plan["populations"] == [50, 300_000]
    hf, batched = plan["generate"]
    assert hf["tokens_per_s"] == 160 and batched["tokens_per_s"] == 1200
    subset = batched["runs"][1]
    assert subset["tokens"] == 300_000 * 48
    assert subset["wall_s"] == pytest.approx(300_000 * 48 / 1200 / 2)  # two workers
    assert subset["gpu_hours"] == pytest.approx(300_000 * 48 / 1200 / 3600)
    # No extraction rate given: one is assumed (compute-bound prefill of the layers the engine runs), and said.
    [assumed] = plan["extract"]
    memory = plan["extract_memory"]
    assert memory["engine"] == "transformers" and memory["gpus_per_worker"] == 1
    assert assumed["tokens_per_s"] == memory["tokens_per_s"] and assumed["label"].startswith("assumed ")
    assert assumed["assumption"].startswith("compute-bound prefill at 50% of 790 TFLOP/s bf16 per H200 x 1 GPU(s)")
    assert assumed["runs"][0]["tokens"] == pytest.approx(50 * (exact / 50 + 48))
    assert plan["gpus_per_worker"] == {"generate": 1, "extract": 1}
    shards = plan["shards"]
    per_sample = exact / 50 + 48
    assert shards["samples"] == 8 and shards["tokens_per_sample"] == pytest.approx(per_sample)
    assert shards["shard_bytes"] == pytest.approx(8 * per_sample * (3 * 128 * 2 + 5) + 8 * 9)
    assert shards["task_slots"] == 3 and shards["staging_bytes"] == pytest.approx(2 * shards["shard_bytes"])
    assert shards["task_host_bytes"] == pytest.approx(
        2 * 2048 * 3 * 128 * 4 + per_sample * 3 * 128 * 2 + per_sample * 3 * 128 * 4  # float32 model, bf16 stored
    )
    assert not shards["too_large"]


def test_plan_sizes_a_vllm_extract_worker_by_its_tensor_parallel_group(make_config):
    config = make_config(
        extract={"engine": "vllm"},
        **{"extract.vllm": {"tensor_parallel_size": 2, "gpu_memory_utilization": 0.5}},
    )
    plan = plan_json(config, "--gpu-memory-gib", "1", "--extract-tokens-per-second", "1000")
    # Workers of the vLLM lane span its tensor_parallel_size; --gpus defaults to one such worker.
    assert plan["gpus"] == 2 and plan["gpus_per_worker"] == {"generate": 1, "extract": 2}
    [given] = plan["extract"]
    assert given["tokens_per_s"] == 1000 and given["assumption"] == ""
    assert given["runs"][0]["wall_s"] == pytest.approx(given["runs"][0]["tokens"] / 1000)  # one worker
    assert len(plan["generate"][0]["runs"]) == 1 and plan["generate"][0]["runs"][0]["gpus_per_worker"] == 1
    memory = plan["extract_memory"]
    # The tiny model: 1,575,296 float32 parameters (tests/ops/test_extract_memory.py), half on each GPU; 3,072 B of
    # keys and values and 1,536 B of hidden states per token; half of 1 GiB less the weights for the cache.
    assert memory["weight_bytes_per_gpu"] == 1_575_296 * 4 / 2
    assert (memory["kv_cache_bytes_per_token"], memory["hidden_state_cache_bytes_per_token"]) == (3072, 1536)
    assert memory["tokens_in_flight"] == (2**29 - 1_575_296 * 2) // 4608
    per_worker = plan_json(config, "--gpus-per-worker", "1", "--gpus", "3")  # the option still sets every lane
    assert per_worker["gpus_per_worker"] == {"generate": 1, "extract": 1}
    assert per_worker["extract_memory"]["gpus_per_worker"] == 1
    refused = dflash_queue("plan", SAMPLE, "-c", config.source, "--gpus", "3", timeout=300)
    assert refused.returncode == 2 and "3 GPUs do not split into extract workers of 2" in refused.stderr


@pytest.mark.vllm
def test_the_shipped_235b_config_plans_a_tensor_parallel_8_worker_per_node(tiny_model, redis_url, tmp_path):
    """worker_configs/qwen3-235b-a22b-h200-tp8.toml against its target's architecture (examples/
    qwen3-235b-a22b-class: the config alone), with the tiny model's tokenizer for the prompts."""
    from transformers import AutoConfig

    from dflash_queue.config import load_config
    from dflash_queue.engines.layers import resolve_layer_ids
    from dflash_queue.engines.vllm.support import vllm_refusal
    from dfq_testing.configs import local_copy

    target = REPO / "examples" / "qwen3-235b-a22b-class"
    shipped = REPO / "worker_configs" / "qwen3-235b-a22b-h200-tp8.toml"
    config = load_config(local_copy(shipped, tmp_path, model=target, tokenizer=tiny_model, broker_url=redis_url))
    model_config = AutoConfig.from_pretrained(target)
    assert resolve_layer_ids(config.extract.layer_ids, 94, config.extract.num_draft_layers) == [1, 24, 46, 68, 91]
    assert vllm_refusal(model_config) is None
    assert (config.extract.engine, config.extract.vllm.tensor_parallel_size) == ("vllm", 8)
    assert (config.generate.engine, config.generate.vllm.tensor_parallel_size) == ("vllm", 8)

    plan = plan_json(config)
    memory = plan["extract_memory"]
    assert plan["gpus"] == 8 and plan["gpus_per_worker"] == {"generate": 8, "extract": 8}
    # 235,093,634,560 parameters (tests/ops/test_model_size.py), bf16, over 8 GPUs: 58.8 GB (54.7 GiB) each.
    assert memory["parameters"] == 235_093_634_560
    assert memory["weight_bytes_per_gpu"] == 235_093_634_560 * 2 / 8
    # 94 layers x 2 x 1 key/value head (4 over 8 GPUs) x 128 x 2 B, and 5 aux layers x 4096 x 2 B per token.
    assert (memory["kv_cache_bytes_per_token"], memory["hidden_state_cache_bytes_per_token"]) == (48_128, 40_960)
    assert memory["tokens_in_flight"] > 20 * config.extract.vllm.max_model_len and memory["warnings"] == []
    assert not plan["shards"]["too_large"]


def test_plan_warns_when_a_shard_would_exceed_max_shard_bytes(make_config):
    config = make_config(extract={"max_shard_bytes": 100_000}, **{"generate.sampling": {"max_tokens": 48}})
    assert plan_json(config)["shards"]["too_large"]
    result = subprocess.run(
        [sys.executable, "-m", "dflash_queue", "plan", str(SAMPLE), "-c", config.source],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "400"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "above extract.max_shard_bytes (100.0 KB)" in result.stdout
    assert "set dataset.shard_size to" in result.stdout
    quiet = subprocess.run(
        [sys.executable, "-m", "dflash_queue", "plan", str(SAMPLE), "-c", make_config("big.toml").source],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "400"},
    )
    assert "extract worker" in quiet.stdout and "warning" not in quiet.stdout


def test_plan_uses_a_runs_measured_averages(make_config, redis_url):
    config = make_config()
    Ledger.from_url(redis_url, config.run.name).add({
        "generate_samples": 10, "generate_completion_tokens": 400, "generate_busy_ms": 2000,
        "extract_tokens": 1500, "extract_busy_ms": 500,
    })
    plan = plan_json(config, "--measured", "--tokens-per-second", "100")
    assert plan["output_tokens"]["per_prompt"] == 40
    assert plan["output_tokens"]["source"] == "measured over 10 generated samples"
    measured_generate = plan["generate"][-1]
    assert measured_generate["tokens_per_s"] == 200 and measured_generate["label"] == "measured 200 tok/s"
    assert measured_generate["runs"][0]["wall_s"] == pytest.approx(50 * 40 / 200)
    assert plan["extract"][0]["tokens_per_s"] == 3000
    # Generation is paced by the tokens it generates, extraction by whole sequences (prompt + completion).
    mean_prompt = plan["prompt_tokens"]["mean_per_prompt"]
    assert measured_generate["runs"][0]["tokens"] == pytest.approx(50 * 40)
    assert plan["extract"][0]["runs"][0]["tokens"] == pytest.approx(50 * (mean_prompt + 40))


def test_plan_text_answers_in_one_table(make_config):
    config = make_config(**{"generate.sampling": {"max_tokens": 4096}})
    result = subprocess.run(
        [sys.executable, "-m", "dflash_queue", "plan", str(SAMPLE), "-c", config.source, "--subset", "300000",
         "--subset", "1000000", "--thinking-tokens", "1370"],
        capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "160"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    # 1M prompts x 1,370 tokens at 160 tok/s: 99.1 days; at 1,200: 13.2 days; 300K at 1,200: 4.0 days.
    assert "99.1 days" in out and "13.2 days" in out and "4.0 days" in out
    assert "generation (generated tokens) on 1 GPU(s)" in out
    assert "extract GPUs" in out and "transformers, 1 GPU(s) per worker of 140.4 GiB" in out
    assert re.search(r"^assumes [\d,]+ tok/s per worker: compute-bound prefill at 50% of 790 TFLOP/s", out, re.M)


def test_an_extract_worker_on_vllm_holds_a_sequence_per_computing_task(make_config):
    from dflash_queue.ops.shard_sizing import size_shards

    config = make_config(
        extract={"engine": "vllm", "hidden_dtype": "bfloat16", "canary_samples": 1},
        **{"extract.vllm": {"inflight_tasks": 3, "dtype": "bfloat16"}},
    )
    sizing = size_shards(
        config.extract, config.dataset, config.storage.uploader, config.model,
        num_layers=5, hidden_size=5120, tokens_per_sample=2000,
    )
    assert sizing.computing_tasks == 3 and sizing.task_slots == 3 + config.storage.uploader.max_pending
    # Per task: 2,000 tokens x 5 layers x 5,120 values, read and waiting (2 x 2 bytes), converted (2), canary (2).
    assert sizing.task_host_bytes == 3 * 2000 * 5 * 5120 * (2 * 2 + 2 + 2)


@pytest.mark.parametrize(
    ("shipped", "target"),
    [
        ("qwen3.6-27b-h200.toml", "qwen3.6-27b-class"),
        pytest.param("qwen3-235b-a22b-h200-tp8.toml", "qwen3-235b-a22b-class", marks=pytest.mark.vllm),
    ],
)
def test_the_shipped_gpu_configs_pass_their_own_plan_and_doctor_given_the_architecture(
    shipped, target, tiny_model, redis_url, tmp_path
):
    """Without the weights on this machine: --model-config gives the target's architecture (its config.json),
    --tokenizer a tokenizer for the prompts; the shipped config plans without a warning."""
    from click.testing import CliRunner

    from dflash_queue.cli import main

    given = ["-c", str(REPO / "worker_configs" / shipped), "--model-config", str(REPO / "examples" / target),
             "--tokenizer", str(tiny_model)]
    env = {"COLUMNS": "300", "DFQ_BROKER_URL": redis_url, "DFQ_STORAGE_URL": str(tmp_path / "storage")}
    planned = CliRunner(env=env).invoke(main, ["plan", str(SAMPLE), *given, "--gpus", "8"])
    assert planned.exit_code == 0, planned.output
    assert "warning" not in planned.output and "shards" in planned.output
    doctor = CliRunner(env=env).invoke(main, ["doctor", "--json", *given])
    checks = {check["name"]: check for check in json.loads(doctor.stdout)}
    assert checks["model"]["verdict"] == "pass" and str(REPO / "examples" / target) in checks["model"]["detail"]
    assert checks["architecture"]["verdict"] == "pass" and checks["tokenizer"]["verdict"] == "pass"
    without = CliRunner(env=env).invoke(main, ["plan", str(SAMPLE), "-c", str(REPO / "worker_configs" / shipped)])
    assert without.exit_code == 1 and "model.path: no such path" in without.output
