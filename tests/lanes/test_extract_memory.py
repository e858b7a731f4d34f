"""An extract task holds about one forward pass of hidden states on the host, not its shard."""

from __future__ import annotations

import gc

import torch

from dflash_queue.lanes.extract import ExtractLane, build_extractor, extract_lane_settings
from dflash_queue.shards.completions import CompletionRecord, encode_completions
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage


def live_state_bytes(width: tuple[int, int]) -> int:
    """Bytes of every distinct tensor storage alive in the process that holds [..., K, H] states (views of one
    storage counted once)."""
    gc.collect()
    storages: dict[int, int] = {}
    for obj in gc.get_objects():
        if issubclass(type(obj), torch.Tensor) and obj.dim() >= 2 and tuple(obj.shape[-2:]) == width:
            storage = obj.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
    return sum(storages.values())


def test_a_task_holds_about_one_pass_of_states_whatever_the_shard_size(make_config):
    config = make_config(extract={"num_draft_layers": 3, "token_budget": 120, "hidden_dtype": "bfloat16"})
    storage = open_storage(config.storage)
    records = [
        CompletionRecord(f"s{i:02d}", list(range(3, 23)), [(7 * i + j) % 500 + 3 for j in range(40)], "stop", False, "")
        for i in range(32)
    ]
    storage.write_bytes(completions_key("big"), encode_completions(records))

    extractor = build_extractor(config)
    width = (len(extractor.captured), extractor.hidden_size)
    peaks: list[int] = []
    run_pass = extractor._run

    def measured_pass(*args, **kwargs):
        peaks.append(live_state_bytes(width))  # what earlier passes left alive when the next one starts
        return run_pass(*args, **kwargs)

    extractor._run = measured_pass
    lane = ExtractLane(extract_lane_settings(config), extractor, storage)
    summary = lane.run("big")
    lane.close()

    per_token = width[0] * width[1] * extractor.dtype.itemsize
    one_pass = config.extract.token_budget * per_token
    shard_states = summary.num_tokens * per_token
    assert len(peaks) >= 16 and shard_states >= 15 * one_pass
    # The pass still being handed over, the canary's copy of one sample and the writer's conversion of one.
    assert max(peaks) <= 2 * one_pass, (max(peaks), one_pass, shard_states)
    with storage.local_copy(shard_key("big")) as path:
        shard = TrainingShard(path)
        assert len(shard) == 32 and shard.num_tokens == summary.num_tokens == 32 * 60
