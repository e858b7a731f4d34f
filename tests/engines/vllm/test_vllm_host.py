"""vLLM on a CPU device: the cores of tensor-parallel ranks and the KV cache the worker sizes when none is set (the
engines that run with them: tests/lanes/test_vllm_tensor_parallel.py, tests/test_end_to_end_vllm_extract.py)."""

from __future__ import annotations

import os

import pytest
from transformers import AutoConfig

from dflash_queue.engines.vllm import host as vllm_host
from dflash_queue.engines.vllm.host import (
    CACHE_HEADROOM,
    THREADS_BIND_ENV,
    bind_rank_threads,
    cache_bytes_per_token,
    cpu_kv_cache_bytes,
    size_cpu_kv_cache,
    threads_bind,
)
from dflash_queue.errors import ConfigError

GIB = 2**30


@pytest.mark.parametrize(
    ("cores", "ranks", "binding"),
    [
        ([0, 1], 2, "0|1"),  # this machine: one core per rank, nothing to spare
        ([0, 1, 2, 3], 2, "0-1|2-3"),  # one spare core per rank would leave a rank one core: all used
        (list(range(16)), 2, "0-6|7-13"),  # cores 14 and 15 left to vLLM's engine process
        (list(range(16)), 4, "0-2|3-5|6-8|9-11"),
        ([2, 3, 6, 7], 2, "2-3|6-7"),  # the cores this process may use, wherever they are
        ([0, 2, 4, 6, 8, 10, 12, 14], 2, "0,2,4|6,8,10"),
        ([5], 1, "5"),
    ],
)
def test_each_rank_gets_a_share_of_the_cores_this_process_may_use(cores, ranks, binding):
    assert threads_bind(cores, ranks) == binding
    shares = [part.split(",") for part in binding.split("|")]
    assert len(shares) == ranks


def test_fewer_cores_than_ranks_cannot_be_bound():
    with pytest.raises(ValueError, match="2 core"):
        threads_bind([0, 1], 4)


def test_the_worker_binds_tensor_parallel_ranks_unless_told(make_config, monkeypatch):
    monkeypatch.delenv(THREADS_BIND_ENV, raising=False)
    config = make_config(extract={"engine": "vllm"}, **{"extract.vllm": {"tensor_parallel_size": 2}})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    bind_rank_threads(config.extract.vllm)  # this machine: one NUMA node, so vLLM's own binding would refuse
    assert os.environ[THREADS_BIND_ENV] == "0|1"
    monkeypatch.setenv(THREADS_BIND_ENV, "nobind")  # the user's choice is kept
    bind_rank_threads(config.extract.vllm)
    assert os.environ[THREADS_BIND_ENV] == "nobind"
    monkeypatch.delenv(THREADS_BIND_ENV)
    bind_rank_threads(make_config("one.toml", extract={"engine": "vllm"}).extract.vllm)  # one rank: vLLM's own
    assert THREADS_BIND_ENV not in os.environ
    four = make_config("four.toml", extract={"engine": "vllm"}, **{"extract.vllm": {"tensor_parallel_size": 4}})
    with pytest.raises(ConfigError, match=r"extract.vllm.tensor_parallel_size is 4 but this process may use 2 CPU "
                                          r"core\(s\) \(os.sched_getaffinity\).* set VLLM_CPU_OMP_THREADS_BIND"):
        bind_rank_threads(four.extract.vllm)
    assert THREADS_BIND_ENV not in os.environ


def test_the_cache_one_token_takes_counted_from_the_shapes(tiny_model):
    text = AutoConfig.from_pretrained(tiny_model)
    # 6 attention layers x keys and values x 1 key/value head of 64 x 4 bytes (float32).
    assert cache_bytes_per_token({"dtype": "float32"}, text) == 6 * 2 * 1 * 64 * 4
    assert cache_bytes_per_token({"dtype": "auto"}, text) == 6 * 2 * 64 * 4  # the checkpoint's own dtype
    assert cache_bytes_per_token({"dtype": "bfloat16"}, text) == 6 * 2 * 64 * 2
    # The extract engine also caches the residual stream of its aux layers, whole on every rank.
    extract = {
        "dtype": "float32",
        "tensor_parallel_size": 2,
        "speculative_config": {
            "method": "extract_hidden_states",
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 6]}},
        },
    }
    # One key/value head cannot be split: both ranks cache it.
    assert cache_bytes_per_token(extract, text) == 6 * 2 * 64 * 4 + 3 * 128 * 4


def test_the_cache_holds_the_sequences_in_flight_within_a_share_of_free_memory():
    size, refusal = cpu_kv_cache_bytes(1000, max_model_len=4096, sequences=16, ranks=1, free_bytes=20 * GIB)
    assert refusal is None and size == int(16 * 4096 * 1000 * CACHE_HEADROOM)
    # Bounded by a quarter of what is free, over the ranks.
    size, refusal = cpu_kv_cache_bytes(100_000, max_model_len=4096, sequences=256, ranks=2, free_bytes=8 * GIB)
    assert refusal is None and size == GIB
    # Not even one sequence fits: refused.
    size, refusal = cpu_kv_cache_bytes(1_000_000, max_model_len=32768, sequences=1, ranks=1, free_bytes=8 * GIB)
    assert size == 0 and refusal.startswith("one sequence of max_model_len (32,768 tokens) needs 38.15 GiB")


def test_a_cpu_engine_without_a_cache_size_gets_one(tiny_model, make_config, monkeypatch):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    config = make_config(extract={"engine": "vllm"})
    args = {"model": str(tiny_model), "dtype": "float32", "max_model_len": 2048, "tensor_parallel_size": 1}
    size_cpu_kv_cache(args, config.extract.vllm, in_flight=8)
    assert args["kv_cache_memory_bytes"] == max(vllm_host.CACHE_FLOOR_BYTES, int(8 * 2048 * 3072 * CACHE_HEADROOM))
    given = {**args, "kv_cache_memory_bytes": 123}
    size_cpu_kv_cache(given, config.extract.vllm)
    assert given["kv_cache_memory_bytes"] == 123  # a size set is kept
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "2")
    left = dict(args)
    del left["kv_cache_memory_bytes"]
    size_cpu_kv_cache(left, config.extract.vllm)
    assert "kv_cache_memory_bytes" not in left  # vLLM reads it
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
    generate = {"model": str(tiny_model), "dtype": "float32", "max_model_len": 512}
    size_cpu_kv_cache(generate, make_config("generate.toml").generate.vllm)  # max_num_seqs (256) sequences
    assert generate["kv_cache_memory_bytes"] == int(256 * 512 * 3072 * CACHE_HEADROOM)
    with pytest.raises(ConfigError, match=r"^vLLM generate engine on the CPU: .* set generate.vllm.kv_cache_memory_gib"):
        size_cpu_kv_cache({"model": str(tiny_model), "dtype": "float32", "max_model_len": 10**9}, config.generate.vllm)
    huge = {**left, "max_model_len": 10**9}
    with pytest.raises(ConfigError, match=r"^vLLM extract engine on the CPU: one sequence of max_model_len .* set "
                                          r"extract.vllm.kv_cache_memory_gib \(or VLLM_CPU_KVCACHE_SPACE\), or lower "
                                          r"extract.vllm.max_model_len$"):
        size_cpu_kv_cache(huge, config.extract.vllm)
