"""Conformance: for every model family drafters are trained for, the stored hidden states equal the model's own
forward pass over each sample alone, through the real generate and extract lanes.

One tiny random-weight model per family (built from Transformers' config classes, weights scaled so that a wrong
answer shows; dfq_testing.families). Its own Transformers engine regenerates the replies (greedy, so
they can be checked against the model's own `generate`), then the extract lane packs them with a token budget
that puts several samples in a pass and needs several passes, and stores every layer (and the final-norm state).
The reference is the checkpoint's own class (`Qwen3_5ForConditionalGeneration` for a multimodal Qwen3.5) run on
one sample at a time with `output_hidden_states`, in its attention that applies all its features.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.lanes.extract import ExtractLane, build_extractor
from dflash_queue.lanes.generate import GenerateLane, build_generate_engine
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage
from dfq_testing.families import FAMILIES, NUM_LAYERS
from dfq_testing.jobs import stage_samples
from dfq_testing.pipeline_shards import FLAG_EVERYTHING
from dfq_testing.references import reference_model, reference_states

SAMPLE = Path(__file__).resolve().parent / ".." / "examples" / "sharegpt_sample.jsonl"
SAMPLES = 10
# Sequences here run ~35-75 tokens: a 160-token budget packs two to four per pass and needs several passes.
TOKEN_BUDGET = 160
pytestmark = pytest.mark.slow


def family_config(make_config, path: Path, name: str, hidden_dtype: str):
    final_norm = name != "lfm2"  # LFM2 names its final norm otherwise; the engine refuses final_norm_state there
    return make_config(
        f"{name}-{hidden_dtype}.toml",
        model={"path": str(path), "name": name, "dtype": "float32", "device": "cpu"},
        dataset={"shard_size": SAMPLES, "thinking": "never"},
        generate={"engine": "transformers", "batch_size": 1},
        **{"generate.sampling": {"temperature": 0.0, "max_tokens": 16}},
        extract={
            "layer_ids": list(range(NUM_LAYERS)),
            "token_budget": TOKEN_BUDGET,
            "hidden_dtype": hidden_dtype,
            "final_norm_state": final_norm,
            "last_layer_state": True,
        },
        quality=FLAG_EVERYTHING,
    )


class PassLog:
    """Sequences per packed forward pass of the extractor (the canary's single-sequence passes are not packed)."""

    def __init__(self, model) -> None:
        self.packed: list[int] = []
        self.handle = model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, _module, _args, kwargs):
        bounds = kwargs.get("packed_bounds")
        if bounds is not None:
            self.packed.append(len(bounds) - 1)
        elif kwargs.get("attention_mask") is not None:  # a padded batch
            self.packed.append(kwargs["input_ids"].shape[0])


@pytest.mark.parametrize("hidden_dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", list(FAMILIES))
def test_stored_states_equal_each_sample_run_alone(name, hidden_dtype, tiny_family, make_config, tmp_path):
    family = FAMILIES[name]
    path = tiny_family(name)
    config = family_config(make_config, path, name, hidden_dtype)
    storage = open_storage(config.storage)
    samples = [s for s in read_dataset([SAMPLE], max_record_bytes=1 << 20) if isinstance(s, Sample)][:SAMPLES]
    shard_id = stage_samples(storage, samples)

    generate = GenerateLane(config, build_generate_engine(config), storage)
    generate.run(shard_id)
    generate.close()
    completions = decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)
    assert len(completions) == SAMPLES

    extractor = build_extractor(config)
    assert extractor.mode == family.mode
    log = PassLog(extractor.model)
    lane = ExtractLane(config, extractor, storage)
    summary = lane.run(shard_id)
    lane.close()
    assert summary.num_samples == SAMPLES
    assert len(log.packed) >= 2 and max(log.packed) >= 2, log.packed  # several passes, several samples in one

    model = reference_model(path, family.reference_attention)
    with storage.local_copy(shard_key(shard_id)) as shard_path:
        shard = TrainingShard(shard_path)
        meta = shard.info()
        layer_states = json.loads(meta["layer_states"])
        assert json.loads(meta["layer_ids"])[:NUM_LAYERS] == list(range(NUM_LAYERS))
        assert meta["extraction"] == family.mode
        canary = json.loads(meta["canary"])
        assert len(canary["samples"]) == 1 and canary["relative_error"] <= 1e-4
        by_id = {c.id: c for c in completions}
        for index in range(len(shard)):
            sample = shard[index]
            completion = by_id[sample.id]
            assert sample.input_ids.tolist() == completion.input_ids
            want = reference_states(model, sample.input_ids, list(zip(json.loads(meta["layer_ids"]), layer_states)))
            got = sample.hidden_states.float()
            assert got.shape == want.shape
            for k in range(got.shape[1]):
                scale = float(want[:, k].abs().max())
                assert scale > 1.0  # scaled weights: states far from zero, so an error would show
                if hidden_dtype == "float32":
                    torch.testing.assert_close(got[:, k], want[:, k], rtol=1e-5, atol=1e-5 * scale)
                else:  # bfloat16 storage: the reference rounded, within one bf16 step
                    torch.testing.assert_close(got[:, k], want[:, k], rtol=2**-7, atol=1e-5 * scale)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_generate_lane_replies_are_the_models_own_greedy_generation(name, tiny_family, make_config):
    """The Transformers engine on every family (a multimodal checkpoint through its text-only causal LM) gives
    the same greedy reply as the checkpoint's own class generating from the same prompt ids."""
    family = FAMILIES[name]
    path = tiny_family(name)
    config = family_config(make_config, path, name, "float32")
    storage = open_storage(config.storage)
    samples = [s for s in read_dataset([SAMPLE], max_record_bytes=1 << 20) if isinstance(s, Sample)][:4]
    shard_id = stage_samples(storage, samples)
    generate = GenerateLane(config, build_generate_engine(config), storage)
    generate.run(shard_id)
    generate.close()

    model = reference_model(path, family.reference_attention)
    eos = list(model.generation_config.eos_token_id)
    for record in decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id):
        prompt = record.prompt_ids
        with torch.inference_mode():
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=eos, pad_token_id=eos[-1]
            )
        own = out[0, len(prompt):].tolist()
        while own and own[-1] == eos[-1] and len(own) > len(record.completion_ids):
            own.pop()
        assert record.completion_ids == own, (record.id, record.completion_ids, own)
