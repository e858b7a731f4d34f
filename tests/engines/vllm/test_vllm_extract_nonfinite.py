"""The vLLM extract engine's check for non-finite states, through the extract lane on vLLM's CPU build: each
sample whose states hold a NaN or an infinity is a dead letter of its own, found without running any batch again,
and the rest of its shard is stored. The NaN and the infinity are put in the states by the KV connector (fault
injection) before it computes their statistics, as a GPU that produced them would hand them over: the worker
finds them in the statistics alone."""

from __future__ import annotations

import random

import pytest

from dflash_queue.engines.vllm.extract import VllmStateExtractor
from dflash_queue.errors import NonFiniteHiddenStates
from dflash_queue.lanes.extract import ExtractLane, extract_lane_settings, vllm_extract_settings
from dflash_queue.shards.completions import CompletionRecord, encode_completions
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.usefixtures("vllm_forked_engine_cores", "vllm_uniproc_executor"),
]

# Two shards, each with one sample the connector makes non-finite.
SHARDS = {
    "nan": {"ok-1": 40, "bad-nan": 70, "ok-2": 90, "ok-3": 25},
    "inf": {"ok-4": 55, "ok-5": 30, "bad-inf": 64, "ok-6": 45},
}
NONFINITE = {"bad-nan": "nan", "bad-inf": "-inf"}

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


def test_states_the_engine_finds_non_finite_cost_their_sample_alone(config, monkeypatch, inject_faults):
    rng = random.Random(0)
    storage = open_storage(config.storage)
    for shard_id, lengths in SHARDS.items():
        records = []
        for sample_id, length in lengths.items():
            ids = [rng.randrange(1000) for _ in range(length)]
            records.append(CompletionRecord(sample_id, ids[: length // 2], ids[length // 2 :], "stop", thinking=False,
                                            text=""))
        storage.write_bytes(completions_key(shard_id), encode_completions(records))

    inject_faults({"extract_vllm_states": {"nonfinite": NONFINITE}})
    engine = VllmStateExtractor(vllm_extract_settings(config))
    received: list[str] = []
    receive = engine._receive

    def counted(request, path):
        received.append(request.sample_id)
        return receive(request, path)

    monkeypatch.setattr(engine, "_receive", counted)
    lane = ExtractLane(extract_lane_settings(config), engine, storage)
    try:
        summaries = {shard_id: lane.run(shard_id) for shard_id in SHARDS}
    finally:
        lane.close()
    for shard_id, lengths in SHARDS.items():
        summary = summaries[shard_id]
        bad = f"bad-{shard_id}"
        assert [(sample, type(exc)) for sample, exc in summary.poisoned] == [(bad, NonFiniteHiddenStates)]
        assert received.count(bad) == 1  # named by the error: never run again, alone or in a half
        assert summary.num_samples == 3
        with storage.local_copy(shard_key(shard_id)) as path:
            assert sorted(TrainingShard(path).sample_ids) == sorted(s for s in lengths if s != bad)
