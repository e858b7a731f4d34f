"""The extract lane checks every shard's states before storing it: the canary (a sample recomputed alone) and the
plausibility checks. On the hybrid Qwen3.5 family, through the real lanes; breakage is injected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_queue import faults
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.engines.state_checks import CanaryMismatch, ImplausibleHiddenStates
from dflash_queue.lanes.extract import ExtractLane, build_extractor
from dflash_queue.lanes.generate import GenerateLane, build_generate_engine
from dflash_queue.shards.keys import prompts_key, shard_key
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage
from dfq_testing.pipeline_shards import FLAG_EVERYTHING

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharegpt_sample.jsonl"


@pytest.fixture
def generated(tiny_family, make_config):
    """One shard of 8 completions of the hybrid Qwen3.5 (multimodal checkpoint), and a config to extract it."""

    def make(**extract):
        config = make_config(
            model={"path": str(tiny_family("qwen3_5")), "name": "qwen3_5", "dtype": "float32", "device": "cpu"},
            dataset={"shard_size": 8, "thinking": "never"},
            **{"generate.sampling": {"max_tokens": 12}},
            extract={"layer_ids": [0, 2, 5], "token_budget": 160, "hidden_dtype": "float32", **extract},
            quality=FLAG_EVERYTHING,
        )
        storage = open_storage(config.storage)
        samples = [s for s in read_dataset([SAMPLE], max_record_bytes=1 << 20) if isinstance(s, Sample)][:8]
        shard_id = prompt_shard_id(samples)
        if not storage.exists(prompts_key(shard_id)):
            storage.write_bytes(prompts_key(shard_id), encode_prompts(samples))
            lane = GenerateLane(config, build_generate_engine(config), storage)
            lane.run(shard_id)
            lane.close()
        return config, storage, shard_id

    return make


@pytest.fixture
def break_packing(monkeypatch):
    monkeypatch.setenv(faults.ENV, json.dumps({"extract_break_packing": True}))
    faults._faults.cache_clear()
    yield
    monkeypatch.delenv(faults.ENV)
    faults._faults.cache_clear()


def test_the_canary_is_recorded_in_the_shard_and_chosen_by_the_shard_id(generated):
    config, storage, shard_id = generated(canary_samples=2)
    lane = ExtractLane(config, build_extractor(config), storage)
    first = lane.run(shard_id)
    with storage.local_copy(shard_key(shard_id)) as path:
        canary = json.loads(TrainingShard(path).info()["canary"])
    again = lane.run(shard_id, redo=True)
    lane.close()
    with storage.local_copy(shard_key(shard_id)) as path:
        assert json.loads(TrainingShard(path).info()["canary"])["samples"] == canary["samples"]
    assert len(canary["samples"]) == 2 and len(set(canary["samples"])) == 2
    with storage.local_copy(shard_key(shard_id)) as path:
        shard = TrainingShard(path)
        lengths = {shard.sample_ids[i]: int(shard.offsets[i + 1] - shard.offsets[i]) for i in range(len(shard))}
    median = sorted(lengths.values())[(len(lengths) - 1) // 2]
    assert all(lengths[sample] <= median for sample in canary["samples"])  # a canary costs at most a median sample
    assert canary["tolerance"] == 1e-4 and len(canary["relative_error_per_layer"]) == 3
    assert first.canary_samples == 2 and first.canary_error == canary["relative_error"] <= 1e-5
    assert again.canary_error == first.canary_error
    assert first.counters()["extract_canary_samples"] == 2


def test_broken_packing_fails_the_task_and_stores_nothing(generated, break_packing):
    config, storage, shard_id = generated()
    lane = ExtractLane(config, build_extractor(config), storage)
    assert lane.extractor.mode == "packed"  # the load probe ran before the fault: only the canary can catch it
    with pytest.raises(CanaryMismatch, match=r"canary sample \S+: layer \d \(decoder_output\) differs from the "
                                             r"sample run alone by relative error \S+ \(worst token"):
        lane.run(shard_id)
    lane.close()
    assert not storage.exists(shard_key(shard_id))


def test_without_the_canary_broken_packing_would_be_stored(generated, break_packing):
    """The check above is the canary's doing: with it off, the same broken states go to storage."""
    config, storage, shard_id = generated(canary_samples=0)
    lane = ExtractLane(config, build_extractor(config), storage)
    summary = lane.run(shard_id)
    lane.close()
    assert summary.canary_error is None and storage.exists(shard_key(shard_id))


def test_a_layer_that_outputs_zeros_fails_the_task(generated):
    """A decoder layer whose output is zeroed (a capture on the wrong module, a layer skipped) gives states no
    forward pass gives; the canary cannot see it (the sample alone is zero too), the plausibility check does."""
    config, storage, shard_id = generated()
    extractor = build_extractor(config)
    extractor.model.layers[2].register_forward_hook(lambda _m, _i, out: torch.zeros_like(out))
    lane = ExtractLane(config, extractor, storage)
    # Layer 2 is captured before the hook zeroes its output; layer 5 then computes on zeros.
    with pytest.raises(ImplausibleHiddenStates, match=r"^8 implausible hidden states: sample \S+, layer 5 \(decoder_output\): all zero"):
        lane.run(shard_id)
    lane.close()
    assert not storage.exists(shard_key(shard_id))
