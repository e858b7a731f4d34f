"""States held to the checkpoint's own forward (engines/reference/check.py), without vLLM: the checkpoint's class
loaded whole and run on each sequence alone (dfq_testing.references, another code path) agrees with the streamed
truth at every entry; states wrong in the ways engines go wrong are refused naming the entry, each of them also in
bfloat16 on a trained checkpoint (SmolLM2-135M-Instruct), where a swap after a long shared prefix hides from the
whole-sequence measure and shows per token. The vLLM engine's own comparison at load is in
tests/engines/vllm/test_vllm_extract_bfloat16.py and tests/test_end_to_end_faults.py."""

from __future__ import annotations

import random
import re

import pytest
import torch
from transformers import AutoTokenizer

from dflash_queue.engines.reference.check import (
    FLOORS,
    ROUNDING_FACTOR,
    ReferenceMismatch,
    compare_with_truth,
    reference_probe_lengths,
    reference_truth,
    require_agreement,
    stored_as,
)
from dflash_queue.engines.reference.streamed import StreamedDecoder
from dflash_queue.errors import UnsupportedArchitecture
from dflash_queue.shards.fp8 import dequantize_fp8, quantize_fp8
from dfq_testing.families import NUM_LAYERS
from dfq_testing.references import reference_model, reference_states

CAPTURED = [(1, "decoder_output"), (3, "decoder_output"), (NUM_LAYERS - 1, "last_layer"), (NUM_LAYERS - 1, "final_norm")]
# SmolLM2-135M-Instruct (30 layers): DFlash's five layers, the last layer before and after the final norm.
TRAINED = [(1, "decoder_output"), (8, "decoder_output"), (14, "decoder_output"), (20, "decoder_output"),
           (27, "decoder_output"), (29, "last_layer"), (29, "final_norm")]


def random_sequences(lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(1000) for _ in range(length)] for length in lengths]


def test_probe_lengths_are_distinct_and_add_up_to_the_budget():
    assert reference_probe_lengths(300, 511) == [30, 60, 90, 120]
    assert reference_probe_lengths(6144, 2047) == [614, 1228, 1843, 2047]  # the longest capped by the context
    lengths = reference_probe_lengths(40, 10)
    assert len(set(lengths)) == 4 and max(lengths) == 10


@pytest.fixture(scope="module")
def qwen3(tiny_family):
    path = tiny_family("qwen3")
    sequences = random_sequences((40, 70, 25))
    model = reference_model(path)
    alone = [reference_states(model, torch.tensor(s), CAPTURED) for s in sequences]
    truth = reference_truth(StreamedDecoder(str(path)), sequences, CAPTURED, torch.float32)
    return sequences, alone, truth


def test_the_checkpoints_whole_class_agrees_with_the_streamed_truth_at_every_entry(qwen3):
    _, alone, truth = qwen3
    comparison = compare_with_truth(alone, truth, CAPTURED)
    assert [entry.name for entry in comparison.entries] == [f"{layer} ({kind})" for layer, kind in CAPTURED]
    assert comparison.agrees and comparison.lengths == (40, 70, 25) and comparison.device == "cpu"
    for entry in comparison.entries:
        assert entry.error <= 1e-5 and entry.token_error <= 1e-5
        assert (entry.bound, entry.tail_bound, entry.token_bound) == FLOORS[torch.float32]  # own = truth: floors
    require_agreement(comparison, "engine")
    assert "4 entries compared with the checkpoint's own forward (Qwen3ForCausalLM" in comparison.describe()


def shifted(states, k, *, after=0):
    """Entry k's rows at positions >= `after` read one token on."""
    out = states.clone()
    out[after:-1, k] = states[after + 1 :, k]
    return out


@pytest.mark.parametrize(
    ("broken", "entry"),
    [
        (lambda s: [shifted(x, 2) for x in s], f"{NUM_LAYERS - 1} (last_layer)"),  # the deepest entry one token off
        (lambda s: [shifted(x, 0, after=30) if len(x) > 30 else x for x in s], "1 (decoder_output)"),  # past 30
        (lambda s: [x[:, [0, 1, 3, 3]] for x in s], f"{NUM_LAYERS - 1} (last_layer)"),  # taken after the final norm
        (lambda s: [x[:, [1, 1, 2, 3]] for x in s], "1 (decoder_output)"),  # the next layer's states
        (lambda s: [s[1][: len(s[0])], s[1], s[2]], None),  # another request's states (every entry wrong)
    ],
)
def test_states_that_are_not_the_models_are_refused_naming_the_entry(qwen3, broken, entry):
    _, alone, truth = qwen3
    comparison = compare_with_truth(broken(alone), truth, CAPTURED)
    assert not comparison.agrees
    if entry is None:
        assert not any(e.agrees for e in comparison.entries)
        entry = comparison.worst.name
    else:
        assert [e.name for e in comparison.entries if not e.agrees] == [entry]
    with pytest.raises(ReferenceMismatch, match=rf"^vLLM extract engine: layer {re.escape(entry)} differs from the "
                                                r"checkpoint's own forward: worst token \d\.\d\de[-+]\d\d") as refused:
        require_agreement(comparison, "vLLM extract engine")
    assert isinstance(refused.value, UnsupportedArchitecture)  # the worker refuses to start, as for any such model
    assert "more than float32 rounding explains" in str(refused.value)


@pytest.fixture(scope="module")
def trained(trained_model):
    """Real text: two conversations behind the same long system prompt, and a third one, through the model's own
    chat template; the truth and the class's own states in bfloat16, as a bfloat16 shard stores them."""
    tokenizer = AutoTokenizer.from_pretrained(trained_model)
    system = {"role": "system", "content": "You answer briefly and precisely, citing the rule you apply. " * 90}
    questions = ["How many legs does a spider have?", "Name the largest planet of the solar system.",
                 "What is the boiling point of water at sea level in Celsius?"]
    sequences = []
    for i, question in enumerate(questions):
        messages = ([system] if i < 2 else []) + [{"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        sequences.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    shared = next(i for i, (a, b) in enumerate(zip(*sequences[:2])) if a != b)
    decoder = StreamedDecoder(str(trained_model))
    reference = reference_truth(decoder, sequences, TRAINED, torch.bfloat16, stored="bfloat16")
    own = [states.clone() for states in reference.own]
    return sequences, shared, reference, own


def test_a_trained_checkpoint_in_bfloat16_agrees_with_itself_and_refuses_each_fault(trained):
    sequences, shared, reference, own = trained
    assert shared > 1000 and all(len(s) > shared + 5 for s in sequences[:2])
    fine = compare_with_truth(own, reference, TRAINED)
    assert fine.agrees and fine.dtype == torch.bfloat16 and fine.stored == "bfloat16"
    whole, tail, token = FLOORS[torch.bfloat16]
    for entry in fine.entries:  # bounds: ROUNDING_FACTOR x the class's own rounding, at least the floor
        assert 1e-3 < entry.tail_rounding <= entry.token_rounding < 0.15
        assert entry.bound == max(ROUNDING_FACTOR * entry.rounding, whole)
        assert entry.tail_bound == max(ROUNDING_FACTOR * entry.tail_rounding, tail)
        assert entry.token_bound == max(ROUNDING_FACTOR * entry.token_rounding, token)
    faults = {
        "27 (decoder_output)": [shifted(x, 4) for x in own],  # the deepest decoder layer one token off
        "29 (last_layer)": [x[:, [0, 1, 2, 3, 4, 6, 6]] for x in own],  # the last state after the final norm
        "14 (decoder_output)": [shifted(x, 2, after=200) for x in own],  # rows one slot off past 200 tokens
    }
    for name, got in faults.items():
        comparison = compare_with_truth(got, reference, TRAINED)
        entry = next(e for e in comparison.entries if e.name == name)
        assert not entry.agrees and entry.excess > 2, (name, entry)
        with pytest.raises(ReferenceMismatch, match="more than bfloat16 rounding explains"):
            require_agreement(comparison, "engine")
    # Two requests behind the same system prompt exchanged after it: the whole-sequence measure hardly sees it at the
    # middle layers (the first token's massive activation dominates the sequence's norm); every entry's worst token
    # does (and here, the swapped tokens being a few in a hundred, the tokens' 99th percentile too).
    length = min(len(sequences[0]), len(sequences[1]))
    swapped = [own[0].clone(), own[1].clone(), own[2]]
    swapped[0][shared:length], swapped[1][shared:length] = own[1][shared:length], own[0][shared:length]
    comparison = compare_with_truth(swapped, reference, TRAINED)
    middle = next(e for e in comparison.entries if e.name == "14 (decoder_output)")
    assert middle.error < 2 * middle.bound
    assert all(e.token_error > 2 * e.token_bound for e in comparison.entries)
    print(f"\nswap after a {shared}-token prefix, layer 14: whole {middle.error:.3f} (bound {middle.bound:.3f}), "
          f"worst token {middle.token_error:.3f} (bound {middle.token_bound:.3f})")


def test_stored_as_rounds_as_the_shard_stores():
    states = torch.randn(5, 2, 64) * 3
    assert torch.equal(stored_as(states, "bfloat16"), states.to(torch.bfloat16).float())
    assert torch.equal(stored_as(states, "float32"), states)
    assert torch.equal(stored_as(states, "fp8_e4m3"), dequantize_fp8(*quantize_fp8(states), torch.float32))


def test_a_token_rounding_leaves_far_off_passes_a_few_tokens_of_another_state_do_not():
    """The three measures on states of known errors (bfloat16 bounds): rounding-sized noise on every token and one
    token 0.3 off (a state that nearly cancels, which rounding alone can leave that far) agree; three tokens given
    other tokens' states fail on the worst token; one token in twenty off by 0.2 fails on the tokens' tail."""
    from dflash_queue.engines.reference.check import Truth

    generator = torch.Generator().manual_seed(0)
    truth = torch.randn(400, 1, 64, generator=generator)

    def noisy(scale: float) -> torch.Tensor:
        noise = torch.randn(truth.shape, generator=generator)
        return truth + scale * noise * truth.norm(dim=-1, keepdim=True) / noise.norm(dim=-1, keepdim=True)

    reference = Truth([truth], [noisy(0.01)], torch.bfloat16, "", 0.0, "cpu", "test")
    captured = [(3, "decoder_output")]
    rounded = noisy(0.01)
    rounded[17] = truth[17] * 1.3  # 0.3 off: within the single token's floor
    [fine] = compare_with_truth([rounded], reference, captured).entries
    assert fine.agrees and 0.29 < fine.token_error < fine.token_bound == FLOORS[torch.bfloat16][2]
    swapped = rounded.clone()
    swapped[[100, 200, 300]] = truth[[101, 201, 301]]
    [few] = compare_with_truth([swapped], reference, captured).entries
    assert not few.agrees and few.tail_error <= few.tail_bound and few.token_error > few.token_bound
    assert few.worst_token[1] in (100, 200, 300)
    drifting = rounded.clone()
    drifting[::20] = truth[::20] * 1.2
    [tail] = compare_with_truth([drifting], reference, captured).entries
    assert not tail.agrees and tail.token_error <= tail.token_bound and tail.tail_error > tail.tail_bound
