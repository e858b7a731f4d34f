from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from dflash_queue.data.samples import Message, Sample, sample_id
from dflash_queue.errors import NonFiniteRowRefused, ShardFormatError
from dflash_queue.shards.completions import CompletionRecord, decode_completions, encode_completions
from dflash_queue.shards.prompts import decode_prompts, encode_prompts, prompt_shard_id
from dflash_queue.shards.training import ExtractedSample, ShardInfo, TrainingShard
from dflash_queue.shards.training_writer import write_training_shard

INFO = ShardInfo(
    target_model="tiny",
    layer_ids=(1, 3),
    num_model_layers=6,
    hidden_size=8,
    dtype="bfloat16",
    config_fingerprint="abc",
    versions={"torch": torch.__version__},
)


def extracted(name: str, prompt: int, completion: int, seed: int) -> ExtractedSample:
    gen = torch.Generator().manual_seed(seed)
    tokens = prompt + completion
    return ExtractedSample(
        id=name,
        input_ids=torch.randint(0, 100, (tokens,), generator=gen, dtype=torch.int32),
        loss_mask=torch.cat([torch.zeros(prompt, dtype=torch.uint8), torch.ones(completion, dtype=torch.uint8)]),
        hidden_states=torch.randn(tokens, 2, 8, generator=gen),
        finish_reason="stop",
        thinking=True,
    )


def test_training_shard_round_trip_with_random_access(tmp_path):
    samples = [extracted("a", 3, 4, 0), extracted("b", 5, 1, 1), extracted("c", 2, 6, 2)]
    path = tmp_path / "s.safetensors"
    write_training_shard(path, samples, INFO)
    shard = TrainingShard(path)
    assert len(shard) == 3 and shard.num_tokens == 21
    assert shard.sample_ids == ["a", "b", "c"]
    for index, original in enumerate(samples):
        got = shard[index]
        assert torch.equal(got.input_ids, original.input_ids)
        assert torch.equal(got.loss_mask, original.loss_mask)
        assert got.hidden_states.dtype == torch.bfloat16
        assert torch.equal(got.hidden_states, original.hidden_states.to(torch.bfloat16))
    with safe_open(str(path), "pt") as handle:
        meta = handle.metadata()
        assert handle.get_slice("hidden_states").get_shape() == [21, 2, 8]
    assert json.loads(meta["layer_ids"]) == [1, 3]
    assert meta["layer_convention"] == "decoder_layer_output"
    assert meta["hf_hidden_states_index"] == "layer_id + 1"
    assert meta["dtype"] == "bfloat16" and meta["target_model"] == "tiny"
    with pytest.raises(IndexError):
        shard[3]


def test_non_finite_or_misshapen_samples_are_refused_before_writing(tmp_path):
    bad = extracted("nan", 2, 2, 0)
    bad.hidden_states[1, 0, 3] = float("nan")
    with pytest.raises(NonFiniteRowRefused, match="sample nan"):
        write_training_shard(tmp_path / "x.safetensors", [extracted("ok", 2, 2, 1), bad], INFO)
    assert not (tmp_path / "x.safetensors").exists()
    short = extracted("short", 2, 2, 0)
    short = ExtractedSample(short.id, short.input_ids, short.loss_mask[:3], short.hidden_states, "stop", True)
    with pytest.raises(ShardFormatError, match="loss_mask has 3 tokens"):
        write_training_shard(tmp_path / "y.safetensors", [short], INFO)


def test_corrupt_shard_is_a_format_error(tmp_path):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    with pytest.raises(ShardFormatError, match="junk.safetensors: header of 16 bytes but the object holds only 22"):
        TrainingShard(path)


def test_prompt_and_completion_shards_round_trip():
    messages = (Message("system", "Be brief — très."), Message("user", "2+2?"))
    sample = Sample(sample_id(messages), messages, "d.jsonl:4", thinking=False)
    assert decode_prompts(encode_prompts([sample]), what="p") == [sample]
    assert prompt_shard_id([sample]) == prompt_shard_id([sample]) != prompt_shard_id([sample, sample])
    record = CompletionRecord(sample.id, [1, 2], [3, 4, 5], "length", False, "text", "d.jsonl:4")
    assert decode_completions(encode_completions([record]), what="c") == [record]
    with pytest.raises(ShardFormatError, match="c:1: corrupt JSON line"):
        decode_completions(b"{oops\n", what="c")
