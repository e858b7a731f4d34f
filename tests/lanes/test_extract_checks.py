"""The extract lane checks every shard's states before storing it: the canary (a sample recomputed alone) and the
plausibility checks. On the hybrid Qwen3.5 family, through the real lanes; breakage is injected."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.engines.state_checks import CanaryMismatch, ImplausibleHiddenStates
from dflash_queue.lanes.extract import ExtractLane, build_extractor, extract_lane_settings
from dflash_queue.lanes.generate import GenerateLane, build_generate_engine, generate_lane_settings
from dflash_queue.shards.keys import prompts_key, shard_key
from dflash_queue.shards.prompts import encode_prompts, prompt_shard_id
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage
from dfq_testing.pipeline_shards import FLAG_EVERYTHING

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharegpt_sample.jsonl"


@pytest.fixture
def generated(tiny_family, make_config):
    """One shard of 8 completions of the hybrid Qwen3.5 (multimodal checkpoint, or another family), and a config
    to extract it."""

    def make(family: str = "qwen3_5", dtype: str = "float32", **extract):
        config = make_config(
            f"{family}-{dtype}.toml",
            model={"path": str(tiny_family(family)), "name": family, "dtype": dtype, "device": "cpu"},
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
            lane = GenerateLane(generate_lane_settings(config), build_generate_engine(config), storage)
            lane.run(shard_id)
            lane.close()
        return config, storage, shard_id

    return make


@pytest.fixture
def break_packing(inject_faults):
    inject_faults({"extract_break_packing": True})


def test_the_canary_is_recorded_in_the_shard_and_chosen_by_the_shard_id(generated):
    config, storage, shard_id = generated(canary_samples=2)
    lane = ExtractLane(extract_lane_settings(config), build_extractor(config), storage)
    first = lane.run(shard_id)
    with storage.local_copy(shard_key(shard_id)) as path:
        canary = json.loads(TrainingShard(path).info()["canary"])
    again = lane.run(shard_id, redo=True)
    with storage.local_copy(shard_key(shard_id)) as path:
        assert json.loads(TrainingShard(path).info()["canary"])["samples"] == canary["samples"]
    assert len(canary["samples"]) == 2 and len(set(canary["samples"])) == 2
    with storage.local_copy(shard_key(shard_id)) as path:
        shard = TrainingShard(path)
        lengths = {shard.sample_ids[i]: int(shard.offsets[i + 1] - shard.offsets[i]) for i in range(len(shard))}
    # Drawn from a length stratum (a quarter of the shard ranked by length), or the shard's longest.
    assert canary["strata"] == 4 and 0 <= canary["stratum"] < 4
    ranked = sorted(lengths.values())
    stratum = ranked[canary["stratum"] * 2 : canary["stratum"] * 2 + 2]
    assert any(lengths[sample] in stratum for sample in canary["samples"]) or "long" in canary
    tolerance = lane.extractor.canary_tolerance()
    assert canary["tolerance"] == tolerance.whole and canary["head_tolerance"] == tolerance.head
    assert canary["token_tolerance"] == tolerance.token and canary["token_noise"] == tolerance.noise_token
    assert len(canary["relative_error_per_layer"]) == 3 and canary["head_error"] <= tolerance.head
    # Per token over each sample's tokens that matter: its completion (these samples share no prefix).
    assert len(canary["token_error_per_layer"]) == 3 and canary["token_error"] <= tolerance.token
    assert len(canary["focus_error_per_layer"]) == 3 and len(canary["focus_tokens"]) == 2
    assert all(0 < n <= lengths[s] for n, s in zip(canary["focus_tokens"], canary["samples"]))
    # Both canaries followed another sequence, on a shard due for its longest too: the longest that followed one
    # (the engine packs the longest sequences first in their passes).
    assert canary["verdict"] == "pass" and canary["followers"] == 2
    if "long" in canary:
        assert canary["long"]["tokens"] in [lengths[sample] for sample in canary["samples"]]
    assert first.canary_samples == 2 and first.canary_error == canary["relative_error"] <= tolerance.whole
    assert again.canary_error == first.canary_error
    assert first.counters()["extract_canary_samples"] == 2
    lane.close()


def test_broken_packing_fails_the_task_and_stores_nothing(generated, break_packing):
    config, storage, shard_id = generated()
    lane = ExtractLane(extract_lane_settings(config), build_extractor(config), storage)
    assert lane.extractor.mode == "packed"  # the load probe ran before the fault: only the canary can catch it
    # Sequences that see each other: the first tokens of a follower, which see the most of the sequence before it,
    # differ the most.
    with pytest.raises(CanaryMismatch, match=r"canary sample \S+: layer \d \(decoder_output\)(, first 8 tokens,)? "
                                             r"differs from the sample run alone by relative error"):
        lane.run(shard_id)
    lane.close()
    assert not storage.exists(shard_key(shard_id))


def test_without_the_canary_broken_packing_would_be_stored(generated, break_packing):
    """The check above is the canary's doing: with it off, the same broken states go to storage."""
    config, storage, shard_id = generated(canary_samples=0)
    lane = ExtractLane(extract_lane_settings(config), build_extractor(config), storage)
    summary = lane.run(shard_id)
    lane.close()
    assert summary.canary_error is None and storage.exists(shard_key(shard_id))


def test_a_layer_that_outputs_zeros_fails_the_task(generated):
    """A decoder layer whose output is zeroed (a capture on the wrong module, a layer skipped) gives states no
    forward pass gives; the canary cannot see it (the sample alone is zero too), the plausibility check does."""
    config, storage, shard_id = generated()
    extractor = build_extractor(config)
    extractor.model.layers[2].register_forward_hook(lambda _m, _i, out: torch.zeros_like(out))
    lane = ExtractLane(extract_lane_settings(config), extractor, storage)
    # Layer 2 is captured before the hook zeroes its output; layer 5 then computes on zeros.
    with pytest.raises(ImplausibleHiddenStates, match=r"^8 implausible hidden states: sample \S+, layer 5 \(decoder_output\): all zero"):
        lane.run(shard_id)
    lane.close()
    assert not storage.exists(shard_key(shard_id))


def test_a_sample_whose_states_are_far_off_the_others_fails_the_task_in_bfloat16(generated, monkeypatch):
    """One sample's states at one layer scaled after the forward pass, before the engine reduces their statistics
    (where a capture of the wrong tensor would put them): its median token RMS is far off the shard's, which the
    statistics computed once, on the engine's side, show; the canary cannot (it compares the pass with the sample
    alone, both through the same code)."""
    from dflash_queue.engines.hf import extract as hf_extract

    config, storage, shard_id = generated(dtype="bfloat16", hidden_dtype="bfloat16", canary_samples=0)
    lane = ExtractLane(extract_lane_settings(config), build_extractor(config), storage)
    finish_pass = hf_extract.finish_pass

    def scaled(group, spans, buffer, *args, **kwargs):
        if 3 in group:  # the shard's fourth sample
            start, end = spans[group.index(3)]
            buffer[start:end, 1] *= 1000
        return finish_pass(group, spans, buffer, *args, **kwargs)

    monkeypatch.setattr(hf_extract, "finish_pass", scaled)
    with pytest.raises(ImplausibleHiddenStates, match=r"^1 implausible hidden states: sample \S+, layer 2 "
                                                      r"\(decoder_output\): median token RMS \S+ is \S+ x the shard's "
                                                      r"median"):
        lane.run(shard_id)
    lane.close()
    assert not storage.exists(shard_key(shard_id))


def test_a_faint_leak_into_the_first_tokens_of_every_follower_fails_the_task_in_bfloat16(generated, inject_faults):
    """A state carried across a pack boundary, 1e-3 of the previous sequence's last state in each follower's first
    8 tokens, in the production dtype: the canary names it by its first tokens (8.3e-4 there against 2.7e-4 over
    these ~40-token samples, where a 2,000-token sample would dilute it 50 times more); the tolerance calibrated in
    bfloat16 is 2e-4, where the fixed bfloat16 tolerance was 2e-2."""
    config, storage, shard_id = generated(dtype="bfloat16", canary_samples=2)
    extractor = build_extractor(config)
    lane = ExtractLane(extract_lane_settings(config), extractor, storage)
    assert extractor.canary_tolerance().head < 1e-3
    inject_faults({"extract_leak_head": {"relative": 1e-3, "tokens": 8}})
    with pytest.raises(CanaryMismatch, match=r"first 8 tokens, differs from the sample run alone by relative error "
                                             r"\S+ \(whole sample \S+; tolerance \S+\): something runs on across"):
        lane.run(shard_id)
    lane.close()
    assert not storage.exists(shard_key(shard_id))


def test_bfloat16_extraction_raises_no_false_alarm(generated):
    config, storage, shard_id = generated(dtype="bfloat16", canary_samples=8)
    lane = ExtractLane(extract_lane_settings(config), build_extractor(config), storage)
    summary = lane.run(shard_id)
    lane.close()
    with storage.local_copy(shard_key(shard_id)) as path:
        canary = json.loads(TrainingShard(path).info()["canary"])
    assert summary.canary_samples == 8 and canary["verdict"] == "pass" and canary["followers"] >= 1
    assert canary["relative_error"] <= canary["tolerance"] and canary["head_error"] <= canary["head_tolerance"]


def test_a_shard_whose_samples_each_ran_alone_is_untestable_not_passed(generated):
    """With a token budget below every sample, each runs alone in its pass: no leak between sequences could show,
    and the shard says so instead of recording a pass."""
    config, storage, shard_id = generated(canary_samples=2, token_budget=8)
    lane = ExtractLane(extract_lane_settings(config), build_extractor(config), storage)
    summary = lane.run(shard_id)
    lane.close()
    with storage.local_copy(shard_key(shard_id)) as path:
        canary = json.loads(TrainingShard(path).info()["canary"])
    assert canary["verdict"] == "untestable" and canary["followers"] == 0
    assert summary.canary_untestable and summary.counters()["extract_canary_untestable"] == 1


def write_short_completions(config, shard_id: str, count: int, length: int):
    """A completions shard of `count` samples of `length` tokens: shorter than the model's window."""
    import random

    from dflash_queue.shards.completions import CompletionRecord, encode_completions
    from dflash_queue.shards.keys import completions_key

    rng = random.Random(0)
    records = []
    for number in range(count):
        ids = [rng.randrange(1000) for _ in range(length)]
        records.append(CompletionRecord(f"short-{number}", ids[: length // 2], ids[length // 2:], "stop",
                                        thinking=False, text=""))
    storage = open_storage(config.storage)
    storage.write_bytes(completions_key(shard_id), encode_completions(records))
    return storage


@pytest.mark.parametrize("window_every", [1, 0])
def test_past_the_window_only_the_window_canary_sees_a_window_ignored(
    window_every, tiny_family, make_config, inject_faults
):
    """Samples shorter than Mistral's window (16 tokens) cannot show a window the packed path ignores; the shard's
    window canary, a sequence built from them past the window and run after another one, does."""
    config = make_config(
        "mistral.toml",
        model={"path": str(tiny_family("mistral")), "name": "mistral", "dtype": "float32", "device": "cpu"},
        extract={"layer_ids": [0, 2, 5], "token_budget": 160, "hidden_dtype": "float32", "canary_samples": 4,
                 "canary_window_every": window_every},
    )
    storage = write_short_completions(config, "short", count=8, length=12)
    extractor = build_extractor(config)
    assert extractor.coverage_length() == 16
    lane = ExtractLane(extract_lane_settings(config), extractor, storage)
    healthy = lane.run("short", redo=True)
    with storage.local_copy(shard_key("short")) as path:
        meta = TrainingShard(path).info()
    canary = json.loads(meta["canary"])
    assert "injected_faults" not in meta
    if window_every:
        window = canary["window"]
        assert window["tokens"] > 16 and window["reach"] == 16 and window["position"] == 1
        assert window["relative_error"] <= canary["tolerance"] and healthy.canary_window
    else:
        assert "window" not in canary and not healthy.canary_window
    inject_faults({"extract_ignore_window": True})
    if window_every:
        with pytest.raises(CanaryMismatch, match=r"canary sample short:window: layer"):
            lane.run("short", redo=True)
    else:
        lane.run("short", redo=True)  # every sample shorter than the window: the fault passes unseen...
        with storage.local_copy(shard_key("short")) as path:  # ...and the shard says it was made under it
            assert json.loads(TrainingShard(path).info()["injected_faults"]) == {"extract_ignore_window": True}
    lane.close()
