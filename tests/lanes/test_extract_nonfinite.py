"""Non-finite hidden states in the extract lane, from each place that finds them.

The engine finding them in a sample's states (NonFiniteHiddenStates, sample-dependent): that sample alone is a
dead letter and the rest of the shard is stored. The shard writer handed them with statistics that show them
(NonFiniteRowRefused: the engine's own check was skipped), or handed states without statistics at all (the writer
does not read the states to check them): the task fails for good, with no batch run again and nothing stored. Real
lanes on the tiny model; the NaN is put in the model's weights, or in the states an engine hands over.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.engines.base import CapturedStates
from dflash_queue.engines.passes import summarize, token_stats
from dflash_queue.errors import NonFiniteHiddenStates, NonFiniteRowRefused, ShardFormatError
from dflash_queue.lanes.extract import ExtractLane, build_extractor, extract_lane_settings
from dflash_queue.lanes.generate import GenerateLane, build_generate_engine, generate_lane_settings
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key, prompts_key, shard_key
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharegpt_sample.jsonl"


@pytest.fixture
def generated(make_config):
    """One shard of 4 completions by the real generate lane; the id of one sample and a token only it holds."""
    config = make_config(
        dataset={"shard_size": 4, "thinking": "never"},
        **{"generate.sampling": {"max_tokens": 12}},
        extract={"hidden_dtype": "float32"},
    )
    storage = open_storage(config.storage)
    samples = [s for s in read_dataset([SAMPLE], max_record_bytes=1 << 20) if isinstance(s, Sample)][:4]
    shard_id = prompt_shard_id(samples)
    storage.write_bytes(prompts_key(shard_id), encode_prompts(samples))
    generate = GenerateLane(generate_lane_settings(config), build_generate_engine(config), storage)
    generate.run(shard_id)
    generate.close()
    records = decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)
    tokens = {r.id: {t for s in r.training_sequences() for t in s.input_ids} for r in records}
    bad = records[1].id
    own = sorted(tokens[bad] - set().union(*(held for sample, held in tokens.items() if sample != bad)))
    assert own, "the sample shares every token with the others"
    return config, storage, shard_id, bad, own[0]


class CountingEngine:
    """The real engine, counting its batches; `spoil` names a sample whose states it hands over with a NaN, as an
    engine that skipped its own check would: with the statistics of those states, or (`without_statistics`) none."""

    def __init__(self, inner, spoil: str | None = None, *, without_statistics: bool = False) -> None:
        self.inner = inner
        self.spoil = spoil
        self.without_statistics = without_statistics
        self.batches: list[list[str]] = []

    def capture(self, requests, *, deliver, **kwargs):
        self.batches.append([r.sample_id for r in requests])

        def hand_over(index: int, captured: CapturedStates) -> None:
            if requests[index].sample_id == self.spoil:
                states = captured.states.clone()
                states[0, 0, 0] = float("nan")
                summary = None if self.without_statistics else summarize(token_stats(states))
                captured = CapturedStates(states, summary, captured.pass_position)  # type: ignore[arg-type]
            deliver(index, captured)

        return self.inner.capture(requests, deliver=hand_over, **kwargs)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_states_the_engine_finds_non_finite_cost_their_sample_alone(generated):
    config, storage, shard_id, bad, token = generated
    engine = CountingEngine(build_extractor(config))
    with torch.no_grad():
        engine.inner.model.embed_tokens.weight[token] = float("nan")
    lane = ExtractLane(extract_lane_settings(config), engine, storage)
    summary = lane.run(shard_id)
    lane.close()
    assert [(sample, type(exc)) for sample, exc in summary.poisoned] == [(bad, NonFiniteHiddenStates)]
    assert summary.num_samples == 3
    # The error named the sample: it alone was the fault, after its pack mates had been delivered.
    assert len(engine.batches) == 1
    with storage.local_copy(shard_key(shard_id)) as path:
        shard = TrainingShard(path)
        assert bad not in shard.sample_ids and len(shard) == 3
        assert all(torch.isfinite(sample.hidden_states).all() for sample in shard)
        assert shard.metadata["dead_lettered"] == f'["{bad}"]'


@pytest.mark.parametrize("without_statistics", [False, True], ids=["with-statistics", "without-statistics"])
def test_non_finite_states_handed_to_the_writer_fail_the_task_for_good(generated, without_statistics):
    config, storage, shard_id, bad, _ = generated
    engine = CountingEngine(build_extractor(config), spoil=bad, without_statistics=without_statistics)
    lane = ExtractLane(extract_lane_settings(config), engine, storage)
    refused = (
        (ShardFormatError, f"sample {bad}: hidden states handed to the shard writer without the engine's statistics")
        if without_statistics
        else (NonFiniteRowRefused, f"sample {bad}: hidden states contain NaN or Inf")
    )
    with pytest.raises(refused[0], match=refused[1]):
        lane.run(shard_id)
    lane.close()
    assert len(engine.batches) == 1  # not bisected: no sample is to blame
    assert not storage.exists(shard_key(shard_id))
