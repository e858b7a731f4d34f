from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dflash_queue.engines.hf_extract import ExtractionRequest, HiddenStateExtractor, plan_batches


def random_ids(count: int, seed: int, vocab: int = 500) -> list[int]:
    return torch.randint(10, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def extractor(tiny_model):
    return HiddenStateExtractor(str(tiny_model), layer_ids=(0, 2, 4), device="cpu", dtype="float32", token_budget=64)


@pytest.fixture(scope="module")
def reference(tiny_model):
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()


def test_hooks_capture_decoder_layer_outputs(extractor, reference):
    ids = random_ids(20, 0)
    [states] = extractor.extract([ExtractionRequest("a", ids)])
    assert states.shape == (20, 3, extractor.hidden_size)
    with torch.inference_mode():
        out = reference(torch.tensor([ids]), output_hidden_states=True)
    for k, layer in enumerate((0, 2, 4)):
        torch.testing.assert_close(states[:, k], out.hidden_states[layer + 1][0], rtol=1e-5, atol=1e-5)


def test_only_layers_up_to_the_highest_captured_are_kept(extractor):
    assert len(extractor.model.layers) == 5
    assert not hasattr(extractor.model, "lm_head")


def test_padded_batches_equal_samples_run_alone(extractor):
    requests = [ExtractionRequest(str(i), random_ids(n, i)) for i, n in enumerate([5, 17, 9, 30, 2])]
    batched = extractor.extract(requests)
    for request, states in zip(requests, batched):
        [alone] = extractor.extract([request])
        torch.testing.assert_close(states, alone, rtol=1e-5, atol=1e-5)


def test_plan_batches_respects_the_token_budget():
    lengths = [100, 3, 50, 50, 49, 10, 400, 7]
    batches = plan_batches(lengths, token_budget=128)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    for batch in batches:
        width = max(lengths[i] for i in batch)
        assert len(batch) * width <= 128 or len(batch) == 1


def test_one_prefill_equals_step_by_step_generation(tiny_model, extractor):
    """The two-pass claim: states captured while generating token by token (KV cache) equal those from one
    prefill over prompt + completion, for every position the generation computed."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    captured: dict[int, list[torch.Tensor]] = {layer: [] for layer in (0, 2, 4)}
    hooks = [
        model.model.layers[layer].register_forward_hook(
            lambda _m, _i, out, layer=layer: captured[layer].append((out[0] if isinstance(out, tuple) else out)[0])
        )
        for layer in (0, 2, 4)
    ]
    prompt = random_ids(12, 7)
    torch.manual_seed(0)
    with torch.inference_mode():
        generated = model.generate(
            torch.tensor([prompt]), max_new_tokens=24, min_new_tokens=24, do_sample=True, temperature=1.0,
            pad_token_id=0,
        )
    for hook in hooks:
        hook.remove()
    sequence = generated[0].tolist()
    assert len(sequence) == 12 + 24
    stepwise = torch.stack([torch.cat(captured[layer], dim=0) for layer in (0, 2, 4)], dim=1)
    # The last token is sampled but never fed back, so generation computed states for all but it.
    assert stepwise.shape[0] == len(sequence) - 1
    [prefill] = extractor.extract([ExtractionRequest("g", sequence)])
    torch.testing.assert_close(prefill[:-1], stepwise, rtol=1e-4, atol=1e-4)
