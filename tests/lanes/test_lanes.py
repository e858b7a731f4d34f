"""The lanes as plain objects, without a broker: the work a task does, and its idempotence."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.lanes.extract import ExtractLane, build_extractor, extract_lane_settings
from dflash_queue.lanes.generate import GenerateLane, build_generate_engine, generate_lane_settings
from dflash_queue.shards.keys import completions_key, prompts_key, shard_key
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def staged(make_config):
    config = make_config(**{"generate.sampling": {"max_tokens": 16}})
    storage = open_storage(config.storage.url)
    samples = [s for s in read_dataset([REPO / "examples" / "sharegpt_sample.jsonl"], max_record_bytes=1 << 20)
               if isinstance(s, Sample)][:5]
    shard_id = prompt_shard_id(samples)
    storage.write_bytes(prompts_key(shard_id), encode_prompts(samples))
    return config, storage, shard_id


def test_lanes_turn_a_prompt_shard_into_a_training_shard_once(staged):
    config, storage, shard_id = staged
    generate = GenerateLane(generate_lane_settings(config), build_generate_engine(config), storage)
    assert generate.already_stored(shard_id) is None
    first = generate.run(shard_id)
    assert not first.skipped and first.num_samples == 5 and first.completion_tokens > 0
    stored = storage.read_bytes(completions_key(shard_id))
    # What a second delivery of the task gets (the lane task asks before it runs the lane): nothing written.
    again = generate.already_stored(shard_id)
    assert again is not None and again.skipped and again.completion_tokens == first.completion_tokens
    assert again.num_samples == first.num_samples and again.kept == first.kept
    assert storage.read_bytes(completions_key(shard_id)) == stored
    with pytest.raises(ValueError, match="completions are generated in epoch 0 only, not in epoch 1"):
        generate.already_stored(shard_id, epoch=1)

    extract = ExtractLane(extract_lane_settings(config), build_extractor(config), storage)
    assert extract.already_stored(shard_id) is None
    summary = extract.run(shard_id)
    assert not summary.skipped and summary.num_samples == 5
    assert summary.num_tokens == first.prompt_tokens + first.completion_tokens
    with storage.local_copy(shard_key(shard_id)) as path:
        assert len(TrainingShard(path)) == 5
        mtime = path.stat().st_mtime_ns
    repeat = extract.already_stored(shard_id)
    assert repeat is not None and repeat.skipped and repeat.num_tokens == summary.num_tokens
    assert (repeat.num_samples, repeat.num_bytes) == (summary.num_samples, summary.num_bytes)
    assert extract.already_stored(shard_id, epoch=1) is None  # another epoch's file
    with storage.local_copy(shard_key(shard_id)) as path:
        assert path.stat().st_mtime_ns == mtime
