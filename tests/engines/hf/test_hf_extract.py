from __future__ import annotations

import pytest
import torch
from transformers import AutoModel, AutoModelForCausalLM

from dflash_queue.engines.hf.extract import ExtractionRequest, HiddenStateExtractor, finish_pass, hand_over
from dflash_queue.engines.hf.packed_attention import PACKED_ATTENTION
from dflash_queue.errors import NonFiniteHiddenStates, OutOfMemoryAtMinimumBudget


def random_ids(count: int, seed: int, vocab: int = 500) -> list[int]:
    return torch.randint(10, vocab, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def fresh_extractor(tiny_model, **kwargs) -> HiddenStateExtractor:
    return HiddenStateExtractor(
        str(tiny_model), layer_ids=(0, 2, 4), device="cpu", dtype="float32", token_budget=64, **kwargs
    )


@pytest.fixture(scope="module")
def extractor(tiny_model):
    return fresh_extractor(tiny_model)


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


def reference_states(reference, ids: list[int], layers=(0, 2, 4)) -> torch.Tensor:
    with torch.inference_mode():
        out = reference(torch.tensor([ids]), output_hidden_states=True)
    return torch.stack([out.hidden_states[layer + 1][0] for layer in layers], dim=1)


class ForwardLog:
    """Row widths of the forward passes the extractor runs (a pre-hook on its model)."""

    def __init__(self, model, fail_above: int | None = None) -> None:
        self.widths: list[int] = []
        self.fail_above = fail_above
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, _module, _args, kwargs):
        rows, width = kwargs["input_ids"].shape
        assert rows == 1
        if self.fail_above is not None and width > self.fail_above:
            raise torch.OutOfMemoryError(f"test: {width} tokens is more than {self.fail_above}")
        self.widths.append(width)


# Many short sequences, a few longer ones and one longer than the 64-token budget.
MIXED_LENGTHS = [5, 17, 9, 30, 2, 1, 3, 90, 12, 7, 1, 25, 40, 4, 6]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_batches_equal_samples_run_alone(tiny_model, reference, attn):
    extractor = fresh_extractor(tiny_model, attn_implementation=attn)
    requests = [ExtractionRequest(str(i), random_ids(n, i)) for i, n in enumerate(MIXED_LENGTHS)]
    log = ForwardLog(extractor.model)
    packed = extractor.extract(requests)
    log.handle.remove()
    assert sorted(log.widths) == [34, 64, 64, 90]  # the oversize sequence alone, two full packs and the rest
    assert sum(log.widths) == sum(MIXED_LENGTHS)
    for request, states in zip(requests, packed):
        assert states.shape == (len(request.input_ids), 3, extractor.hidden_size)
        torch.testing.assert_close(states, reference_states(reference, request.input_ids), rtol=1e-5, atol=1e-5)


def test_no_sample_sees_another_in_its_pack(extractor):
    first, second = random_ids(20, 1), random_ids(20, 2)
    together = extractor.extract([ExtractionRequest("a", first), ExtractionRequest("b", second)])
    changed = extractor.extract([ExtractionRequest("a", random_ids(20, 3)), ExtractionRequest("b", second)])
    torch.testing.assert_close(together[1], changed[1], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(together[0], changed[0])


def test_an_empty_request_list_runs_nothing(extractor):
    assert extractor.extract([]) == []


def test_out_of_memory_shrinks_the_budget_and_retries(tiny_model, reference):
    extractor = fresh_extractor(tiny_model)
    requests = [ExtractionRequest(str(i), random_ids(n, i)) for i, n in enumerate([24, 20, 12, 9, 5, 3, 1, 18])]
    log = ForwardLog(extractor.model, fail_above=24)
    states = extractor.extract(requests)
    assert extractor.effective_token_budget <= 24
    assert max(log.widths) <= 24
    for request, got in zip(requests, states):
        torch.testing.assert_close(got, reference_states(reference, request.input_ids), rtol=1e-5, atol=1e-5)


def test_out_of_memory_on_one_sequence_alone_names_the_sample(tiny_model):
    extractor = fresh_extractor(tiny_model)
    ForwardLog(extractor.model, fail_above=24)
    requests = [ExtractionRequest("short", random_ids(10, 0)), ExtractionRequest("long", random_ids(30, 1))]
    with pytest.raises(OutOfMemoryAtMinimumBudget, match="long") as caught:
        extractor.extract(requests)
    assert caught.value.sample_ids == ("long",)


def test_non_finite_hidden_states_name_the_sample_and_spare_its_pack_mates(tiny_model):
    extractor = fresh_extractor(tiny_model)
    poisoned_token = 999
    with torch.no_grad():
        extractor.model.embed_tokens.weight[poisoned_token] = float("nan")
    clean = [ExtractionRequest(str(i), random_ids(10, i)) for i in range(3)]
    bad = ExtractionRequest("bad", random_ids(10, 9)[:5] + [poisoned_token] + random_ids(4, 8))
    log = ForwardLog(extractor.model)
    with pytest.raises(NonFiniteHiddenStates) as caught:
        extractor.extract([*clean, bad])
    assert caught.value.sample_ids == ("bad",)
    assert log.widths == [40]  # all four shared one pack
    assert all(torch.isfinite(s).all() for s in extractor.extract(clean))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_a_pass_is_checked_from_its_statistics_in_bfloat16(value):
    """A finished pass in bfloat16 with one NaN or infinite value in its middle sequence: that sequence is named,
    the others are handed over as views of the pass's buffer (no copy) with the per-layer summary of their own
    values (largest, smallest, median token RMS)."""
    buffer = (torch.randn(30, 3, 64, generator=torch.Generator().manual_seed(3)) * 4).to(torch.bfloat16)
    buffer[12, 1, 33] = value
    spans = [(0, 10), (10, 18), (18, 30)]
    requests = [ExtractionRequest(name, [1] * (end - start)) for name, (start, end) in zip("abc", spans)]
    delivered = {}
    nonfinite: list[str] = []
    hand_over(finish_pass([0, 1, 2], spans, buffer, None), requests, delivered.__setitem__, nonfinite)
    assert nonfinite == ["b"] and sorted(delivered) == [0, 2]
    for index, (start, end) in [(0, spans[0]), (2, spans[2])]:
        captured = delivered[index]
        assert captured.states.data_ptr() == buffer[start].data_ptr() and captured.states.shape == (end - start, 3, 64)
        assert captured.pass_position == (0 if index == 0 else 2)
        values = buffer[start:end].double()
        rms = values.square().mean(-1).sqrt()  # [T, K]
        assert captured.summary[:, 0].tolist() == values.amax(dim=(0, 2)).tolist()
        assert captured.summary[:, 1].tolist() == values.amin(dim=(0, 2)).tolist()
        lower_median = rms.sort(dim=0).values[(end - start - 1) // 2]
        torch.testing.assert_close(captured.summary[:, 2].double(), lower_median, rtol=2e-6, atol=0)


def test_activation_estimate_is_linear_in_tokens_and_covers_the_capture_buffers(extractor):
    config = extractor.model.config
    per_token = extractor.activation_bytes(1)
    assert extractor.activation_bytes(1000) == 1000 * per_token
    assert per_token > 2 * 3 * config.hidden_size * 4 + 3 * config.intermediate_size * 4


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


def test_sdpa_runs_attention_per_packed_sequence(extractor):
    assert extractor.model.config._attn_implementation == PACKED_ATTENTION


def test_an_extractor_around_a_model_in_memory_matches_one_loaded_from_its_path(tiny_model, extractor):
    model = AutoModel.from_pretrained(tiny_model, dtype=torch.float32)
    in_memory = HiddenStateExtractor.from_model(model, layer_ids=(0, 2, 4), token_budget=64)
    assert len(model.layers) == 5 and in_memory.num_model_layers == extractor.num_model_layers
    requests = [ExtractionRequest(str(i), random_ids(n, i)) for i, n in enumerate([40, 30, 3])]
    for got, want in zip(in_memory.extract(requests), extractor.extract(requests)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_a_decoder_spread_by_a_device_map_extracts_exactly_the_same_states(tiny_model, extractor, monkeypatch):
    """The engine on a worker's GPU group, with every GPU of its device map replaced by the CPU: the decoder is
    loaded through the map, and the states it captures are those of the decoder on one device."""
    import dflash_queue.engines.hf.extract as hf_extract

    spread_device_map, load_text_decoder = hf_extract.spread_device_map, hf_extract.load_text_decoder
    maps: list[dict] = []

    def load_on_the_cpu(path, **kwargs):
        maps.append(kwargs["device_map"])
        return load_text_decoder(path, **kwargs)

    monkeypatch.setattr(hf_extract, "spread_gpu_count", lambda device: 2)
    monkeypatch.setattr(hf_extract, "spread_device_map",
                        lambda *args: dict.fromkeys(spread_device_map(*args), "cpu"))
    monkeypatch.setattr(hf_extract, "load_text_decoder", load_on_the_cpu)
    spread = fresh_extractor(tiny_model)
    [mapping] = maps
    assert {"embed_tokens", "layers.0", "layers.5", "norm"} <= mapping.keys() and set(mapping.values()) == {"cpu"}
    assert spread.device == torch.device("cpu")
    requests = [ExtractionRequest(str(i), random_ids(12 + 7 * i, i)) for i in range(4)]
    for mine, theirs in zip(spread.extract(requests), extractor.extract(requests), strict=True):
        assert torch.equal(mine, theirs)
