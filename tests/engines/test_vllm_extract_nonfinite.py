"""The vLLM extract engine's check for non-finite states, through the extract lane on vLLM's CPU build: the
sample whose states hold a NaN is a dead letter of its own, found without running any batch again, and the rest
of its shard is stored. The NaN is put in the states the engine reads back from its KV connector."""

from __future__ import annotations

import random

import pytest

from dflash_queue.engines.vllm_extract import VllmStateExtractor
from dflash_queue.errors import NonFiniteHiddenStates
from dflash_queue.lanes.extract import ExtractLane
from dflash_queue.shards.completions import CompletionRecord, encode_completions
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

LENGTHS = {"ok-1": 40, "bad": 70, "ok-2": 90, "ok-3": 25}


@pytest.fixture
def config(tiny_family, tmp_path):
    from dflash_queue.config import load_config
    from dfq_testing.configs import tiny_config_tables, write_config

    tables = tiny_config_tables(tiny_family("qwen3"), tmp_path / "storage", "redis://127.0.0.1:1/0", tmp_path / "state")
    return load_config(
        write_config(
            tmp_path / "config.toml",
            tables,
            model={"name": "qwen3", "dtype": "float32"},
            extract={"engine": "vllm", "hidden_dtype": "float32"},
            **{
                "extract.vllm": {
                    "dtype": "float32",
                    "max_model_len": 512,
                    "max_num_batched_tokens": 64,
                    "max_num_seqs": 16,
                    "enforce_eager": True,
                    "kv_cache_memory_gib": 0.5,
                    "log_stats_interval_s": 0,
                    "shutdown_timeout_s": 30,
                },
            },
        )
    )


def test_states_the_engine_finds_non_finite_cost_their_sample_alone(config, monkeypatch):
    rng = random.Random(0)
    records = []
    for sample_id, length in LENGTHS.items():
        ids = [rng.randrange(1000) for _ in range(length)]
        records.append(CompletionRecord(sample_id, ids[: length // 2], ids[length // 2 :], "stop", thinking=False, text=""))
    storage = open_storage(config.storage)
    storage.write_bytes(completions_key("nan"), encode_completions(records))

    engine = VllmStateExtractor(config)
    received: list[str] = []
    receive = engine._receive

    def spoiled(request, path):
        states = receive(request, path)
        received.append(request.sample_id)
        if request.sample_id == "bad":
            states = states.clone()
            states[3, 0, 0] = float("nan")
        return states

    monkeypatch.setattr(engine, "_receive", spoiled)
    lane = ExtractLane(config, engine, storage)
    try:
        summary = lane.run("nan")
    finally:
        lane.close()
    assert [(sample, type(exc)) for sample, exc in summary.poisoned] == [("bad", NonFiniteHiddenStates)]
    assert received.count("bad") == 1  # named by the error: never run again, alone or in a half
    assert summary.num_samples == 3
    with storage.local_copy(shard_key("nan")) as path:
        assert sorted(TrainingShard(path).sample_ids) == ["ok-1", "ok-2", "ok-3"]
