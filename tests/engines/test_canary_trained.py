"""The canary on a trained checkpoint (SmolLM2-135M-Instruct, 30 layers) in bfloat16 through vLLM's CPU build, where
the whole-sample measure is weakest: a few tokens carry massive activations (RMS 100-170x the median token's at
layers 14 and 20), so a wrong state on ordinary tokens hardly moves the whole sample's error, and a shared system
prompt dilutes it further. Two requests of the same length sharing a system prompt of several hundred tokens,
their states swapped in the batch by the connector (the package's test faults, named by sample id): the canary
fails the shard on the worst of the tokens that matter (the completion and past the shared prefix), where the
whole-sample and first-token measures alone pass it even at their loosest (the bfloat16 ceiling, what a noisy
engine calibrates to). And a shard of ordinary chat samples (one of them a conversation of two turns, each its own
sequence) raises no alarm at the calibrated tolerance. One engine for the module; its load-time reference check is
left to tests/engines/reference/test_reference_check.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from dflash_queue import faults
from dflash_queue.config import load_config
from dflash_queue.engines.base import ExtractionRequest
from dflash_queue.engines.state_checks import (
    TOKEN_CEILINGS,
    TOKEN_FLOORS,
    TOLERANCE_CEILINGS,
    CanaryMismatch,
    TokenFocus,
    compare_states,
)
from dflash_queue.engines.vllm.extract import VllmStateExtractor
from dflash_queue.lanes.canaries import CanaryPicker
from dflash_queue.lanes.extract import ExtractLane, extract_lane_settings, vllm_extract_settings
from dflash_queue.shards.completions import CompletionRecord, ServedTurn, encode_completions
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage
from dfq_testing.chat_texts import chat, conversations
from dfq_testing.configs import tiny_config_tables, write_config

pytestmark = [
    pytest.mark.vllm, pytest.mark.slow,
    pytest.mark.usefixtures("vllm_forked_engine_cores", "vllm_uniproc_executor"),
]

BF16 = torch.bfloat16
# Layers 14 and 20 of 30: where the massive activations dominate each sample's norm.
LAYERS = [14, 20]
FAULTS = {"swap": [["swap-a", "swap-b"], ["measure-a", "measure-b"]]}
LOOSEST = TOLERANCE_CEILINGS[BF16]  # the whole-sample and first-token tolerance of the noisiest calibration


@pytest.fixture(scope="module")
def trained(trained_model, tmp_path_factory):
    """(engine config, tokenizer, engine): SmolLM2 in bfloat16 on vLLM's CPU build, prefilled in 128-token steps,
    the connector swapping the states of the pairs FAULTS names."""
    tmp = tmp_path_factory.mktemp("canary-trained")
    tables = tiny_config_tables(trained_model, tmp / "storage", "redis://127.0.0.1:1/0", tmp / "state")
    config = load_config(
        write_config(
            tmp / "config.toml",
            tables,
            model={"name": "smollm2", "dtype": "bfloat16"},
            extract={"engine": "vllm", "layer_ids": LAYERS},
            **{"extract.vllm": {"max_model_len": 640, "max_num_batched_tokens": 128, "max_num_seqs": 16,
                                "enforce_eager": True, "kv_cache_memory_gib": 0.5, "log_stats_interval_s": 0,
                                "shutdown_timeout_s": 30, "reference_check": False}},
        )
    )
    faults.install({"extract_vllm_states": FAULTS})
    try:
        extractor = VllmStateExtractor(vllm_extract_settings(config))
    finally:
        faults.uninstall()
    yield config, AutoTokenizer.from_pretrained(trained_model), extractor
    extractor.close()


def sharing_a_system_prompt(tokenizer) -> tuple[int, list[tuple[list[int], list[int]]]]:
    """(shared prefix, two (prompt, completion) pairs of the same length whose prompts share a system prompt of
    several hundred tokens: notes from earlier answers)."""
    pairs = conversations()
    notes = "\n\n".join(answer for _, answer in pairs[:3])
    system = f"You are a careful assistant. Notes from earlier answers; use them where they apply.\n\n{notes}"
    first, second = (chat(tokenizer, q, a, system) for q, a in pairs[5:7])
    length = min(len(first[0]) + len(first[1]), len(second[0]) + len(second[1]), 600)
    cut = [(prompt, completion[: length - len(prompt)]) for prompt, completion in (first, second)]
    ids = [prompt + completion for prompt, completion in cut]
    shared = next(i for i, (a, b) in enumerate(zip(*ids)) if a != b)
    assert len(ids[0]) == len(ids[1]) == length and 300 <= shared < length - 100
    return shared, cut


def test_a_swap_past_a_shared_system_prompt_fails_on_the_tokens_that_matter_not_on_the_whole_sample(trained):
    """Measured directly first (the pair in one batch with other requests, each against itself alone), then
    through the extract lane with one canary sample per shard as shipped, its whole-sample and first-token
    tolerance configured at the bfloat16 ceiling."""
    config, tokenizer, extractor = trained
    tolerance = extractor.canary_tolerance()
    shared, pair = sharing_a_system_prompt(tokenizer)
    rng = random.Random(3)
    others = [ExtractionRequest(f"other-{i}", [rng.randrange(49152) for _ in range(n)]) for i, n in enumerate([90, 200])]
    measured = [ExtractionRequest(name, prompt + completion) for name, (prompt, completion) in
                zip(["measure-a", "measure-b"], pair)]
    batch = [others[0], *measured, others[1]]
    got = {r.sample_id: c.states for r, c in zip(batch, extractor.capture(batch))}
    figures = {}
    for request, (prompt, completion) in zip(measured, pair):
        length = len(request.input_ids)
        focus = TokenFocus.of(length, [0] * len(prompt) + [1] * len(completion), shared_prefix=shared)
        figures[request.sample_id] = compare_states(got[request.sample_id], extractor.reference_states(request), focus)
    for other in others:  # the rest of the batch is untouched: bit-identical to alone on the CPU build
        assert compare_states(got[other.sample_id], extractor.reference_states(other)).worst_focus_token == 0.0
    for name, d in figures.items():
        print(f"\n{name} ({len(pair[0][0]) + len(pair[0][1])} tokens, {shared} shared, {d.focus_tokens} that matter):"
              f" whole sample {[f'{e:.3f}' for e in d.relative]} (loosest tolerance {LOOSEST}), first tokens "
              f"{[f'{e:.3f}' for e in d.head]}; worst token that matters {[f'{e:.3f}' for e in d.focus_token]}, "
              f"relative L2 over them {[f'{e:.3f}' for e in d.focus]} (per-token tolerance {tolerance.token:.3f}, "
              f"noise {tolerance.noise_token:.2e})")
        assert d.worst < LOOSEST and d.worst_head == 0.0  # the whole-sample measures pass it even at their loosest
        # Each layer's worst token fails the loosest per-token bound, and 10 x this engine's.
        assert min(d.focus_token) > max(TOKEN_CEILINGS[BF16], 10 * tolerance.token)
        assert min(d.focus) > 0.5  # over the tokens that matter the swap is no longer diluted

    # Through the lane: the swapped sample is the shard's canary.
    lane_config = load_config(write_config(
        Path(config.source).with_name("lane.toml"), tiny_config_tables(
            Path(config.model.path), Path(config.storage.url), "redis://127.0.0.1:1/0", Path(config.run.state_dir)),
        model={"name": "smollm2", "dtype": "bfloat16"},
        extract={"engine": "vllm", "layer_ids": LAYERS, "canary_tolerance": LOOSEST},
    ))
    samples = [("swap-a", *pair[0]), ("swap-b", *pair[1]),
               *(("plain-" + str(i), *chat(tokenizer, q, a)) for i, (q, a) in enumerate(conversations()[8:10]))]
    lengths = [len(prompt) + len(completion) for _, prompt, completion in samples]
    shard_id = next(s for s in (f"trained-swap-{n}" for n in range(100)) if canary_index(lane_config, s, lengths) == 0)
    write_completions(lane_config, shard_id, samples)
    with pytest.raises(CanaryMismatch) as raised:
        run_lane(lane_config, extractor, shard_id)
    message = str(raised.value)
    print(f"\n{message}")
    assert message.startswith("canary sample swap-a: layer ")
    assert f"tokens that matter: its completion and the tokens past the {shared} it shares with another sample" in message
    assert "(checked twice, both sides recomputed)" in message
    assert not open_storage(lane_config.storage).exists(shard_key(shard_id))


def test_a_shard_of_ordinary_chat_samples_raises_no_alarm_at_the_calibrated_tolerance(trained):
    config, tokenizer, extractor = trained
    tolerance = extractor.canary_tolerance()
    assert tolerance.token == TOKEN_FLOORS[BF16] and tolerance.noise_token == 0.0  # batched and alone: bit-identical
    system = "You are a helpful assistant. Answer precisely and show the code or the steps you use."
    samples = [(f"chat-{i}", *chat(tokenizer, q, a, system if i % 2 else None))
               for i, (q, a) in enumerate(conversations()[:8])]
    samples = [(sample_id, prompt, completion[: 600 - len(prompt)]) for sample_id, prompt, completion in samples]
    # A conversation of two turns, each its own training sequence: the first is a prefix of the second, so only its
    # completion (its loss mask) is left to compare per token.
    (q1, a1), (q2, a2) = conversations()[10:12]
    first = chat(tokenizer, q1, a1[:300])
    follow_up = tokenizer.encode(f"\n<|im_start|>user\n{q2}<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    turns = CompletionRecord("chat-turns", first[0] + first[1] + follow_up, chat(tokenizer, q2, a2[:300])[1], "stop",
                             thinking=False, text="", served_turns=(ServedTurn(first[0], first[1], "stop"),))
    records = [CompletionRecord(i, prompt, completion, "stop", thinking=False, text="") for i, prompt, completion in
               samples] + [turns]
    open_storage(config.storage).write_bytes(completions_key("trained-ordinary"), encode_completions(records))
    sequences = len(samples) + 2
    lane_config = load_config(write_config(
        Path(config.source).with_name("ordinary.toml"), tiny_config_tables(
            Path(config.model.path), Path(config.storage.url), "redis://127.0.0.1:1/0", Path(config.run.state_dir)),
        model={"name": "smollm2", "dtype": "bfloat16"},
        extract={"engine": "vllm", "layer_ids": LAYERS, "canary_samples": sequences},
    ))
    summary, storage = run_lane(lane_config, extractor, "trained-ordinary")
    with storage.local_copy(shard_key("trained-ordinary")) as path:
        canary = json.loads(TrainingShard(path).info()["canary"])
    print(f"\nordinary chat samples: {canary['samples']}, whole {canary['relative_error']:.2e}, worst token that "
          f"matters {canary['token_error']:.2e} (per-token tolerance {canary['token_tolerance']:.2e}), shared "
          f"prefixes {canary['shared_prefix_tokens']}, tokens that matter {canary['focus_tokens']}")
    assert summary.canary_samples == sequences and canary["verdict"] == "pass"
    assert canary["token_error"] <= canary["token_tolerance"] == tolerance.token
    assert min(canary["shared_prefix_tokens"]) > 10  # every sample shares a system prompt (its own or the template's)
    # The first turn: the whole sequence is the second turn's prefix; what is left is its completion.
    whole_turn = len(first[0]) + len(first[1])
    assert (whole_turn, len(first[1])) in zip(canary["shared_prefix_tokens"], canary["focus_tokens"])


def canary_index(config, shard_id: str, lengths: list[int]) -> int:
    """The sample the lane's canary picks (one, as shipped) in a shard of these lengths: every sequence of a vLLM
    batch follows another."""
    picker = CanaryPicker(shard_id, lengths, config.extract.canary_samples, config.extract.canary_longest_every)
    for index in range(len(lengths)):
        picker.offer(index, torch.zeros(1), 1)
    [(index, _, _)] = picker.chosen(range(len(lengths)))
    return index


def write_completions(config, shard_id: str, samples) -> None:
    records = [CompletionRecord(sample_id, prompt, completion, "stop", thinking=False, text="")
               for sample_id, prompt, completion in samples]
    open_storage(config.storage).write_bytes(completions_key(shard_id), encode_completions(records))


def run_lane(config, extractor, shard_id):
    storage = open_storage(config.storage)
    lane = ExtractLane(extract_lane_settings(config), extractor, storage)
    try:
        return lane.run(shard_id), storage
    finally:
        lane.uploader.close()  # the engine is the module's
