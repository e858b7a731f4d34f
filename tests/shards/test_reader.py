"""ShardIndex / read_sample: ranged reads of one sample, and the checks that refuse a shard that is not whole."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.fp8 import SCALES_TENSOR
from dflash_queue.shards.ranges import LocalFileSource
from dflash_queue.shards.reader import ShardIndex, read_sample
from dflash_queue.shards.training import ExtractedSample, ShardInfo
from dflash_queue.shards.training_writer import write_training_shard


def info(dtype: str = "bfloat16") -> ShardInfo:
    return ShardInfo("tiny", (1, 3), 6, 8, dtype, "abc", {"torch": torch.__version__})


def extracted(name: str, prompt: int, completion: int, seed: int) -> ExtractedSample:
    gen = torch.Generator().manual_seed(seed)
    tokens = prompt + completion
    return ExtractedSample(
        id=name,
        input_ids=torch.randint(0, 100, (tokens,), generator=gen, dtype=torch.int32),
        loss_mask=torch.cat([torch.zeros(prompt, dtype=torch.uint8), torch.ones(completion, dtype=torch.uint8)]),
        hidden_states=torch.randn(tokens, 2, 8, generator=gen),
        finish_reason="stop" if seed % 2 else "length",
        thinking=bool(seed % 2),
    )


SAMPLES = [extracted("a", 3, 4, 0), extracted("b", 5, 1, 1), extracted("c", 2, 6, 2)]


def safetensors_states(path, sample: int) -> torch.Tensor:
    """One sample's states as safetensors' own reader gives them (fp8 dequantised with its stored scales)."""
    with safe_open(str(path), "pt") as handle:
        offsets = handle.get_tensor("offsets")
        start, end = int(offsets[sample]), int(offsets[sample + 1])
        states = handle.get_slice("hidden_states")[start:end]
        if SCALES_TENSOR in handle.keys():
            return states.float() * handle.get_slice(SCALES_TENSOR)[start:end].unsqueeze(-1)
        return states


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "fp8_e4m3"])
def test_one_sample_read_by_ranges_equals_the_safetensors_reader(tmp_path, dtype):
    path = tmp_path / "s.safetensors"
    write_training_shard(path, SAMPLES, info(dtype))
    source = LocalFileSource(path)
    index = ShardIndex.load(source)
    assert index.sample_ids == ("a", "b", "c") and index.num_tokens == 21 and index.dtype == dtype
    assert index.finish_reasons == ("length", "stop", "length") and index.thinking == (False, True, False)
    assert index.quality_flags == ((), (), ()) and index.layer_ids == (1, 3) and index.hidden_size == 8
    for row, original in enumerate(SAMPLES):
        got = read_sample(index, source, row, torch.bfloat16)
        assert torch.equal(got["input_ids"], original.input_ids.long())
        assert torch.equal(got["loss_mask"], original.loss_mask.long())
        assert got["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(got["hidden_states"], safetensors_states(path, row).to(torch.bfloat16))
        if dtype != "fp8_e4m3":
            as_f32 = read_sample(index, source, row, torch.float32)["hidden_states"]
            assert torch.equal(as_f32, original.hidden_states.to(getattr(torch, dtype)).float())
    meta = index.sample_meta(1)
    assert (meta.id, meta.index, meta.num_tokens, meta.finish_reason) == ("b", 1, 6, "stop")


def rewrite_metadata(path, **changes):
    tensors = load_file(str(path))
    with safe_open(str(path), "pt") as handle:
        metadata = dict(handle.metadata())
    for key, value in changes.items():
        if value is None:
            metadata.pop(key, None)
        else:
            metadata[key] = value
    save_file(tensors, str(path), metadata=metadata)


def test_quality_flags_are_read_from_the_verdicts(tmp_path):
    path = tmp_path / "s.safetensors"
    write_training_shard(path, SAMPLES, info())
    verdicts = [{"flags": ["repetition"], "answer_tokens": 0, "thinking": "closed"}, {"flags": []}, {"flags": ["stub"]}]
    dropped = [{"id": "d", "flags": ["stub"]}]
    rewrite_metadata(path, quality=json.dumps(verdicts), dropped=json.dumps(dropped))
    index = ShardIndex.load(LocalFileSource(path))
    assert index.quality_flags == (("repetition",), (), ("stub",))
    assert index.verdicts == tuple(verdicts) and index.dropped == tuple(dropped)
    rewrite_metadata(path, quality=None, dropped=None)  # written before the quality gate existed
    index = ShardIndex.load(LocalFileSource(path))
    assert index.quality_flags == ((), (), ()) and index.dropped == ()
    assert index.verdicts == ({"flags": [], "answer_tokens": 0, "thinking": "none"},) * 3


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"format": "other"}, "metadata format is 'other'"),
        ({"dtype": "int4"}, "metadata dtype 'int4' is not one of"),
        ({"dtype": "float32"}, "tensor 'hidden_states' is BF16, expected F32"),
        ({"layer_ids": "[1, 2, 3]"}, "tensor 'hidden_states' has shape \\[21, 2, 8\\], expected \\[21, 3, 8\\]"),
        ({"hidden_size": "eight"}, "metadata 'hidden_size' is 'eight', not an integer"),
        ({"layer_states": '["decoder_output"]'}, "layer_states .* per layer id \\(2\\)"),
        ({"layer_states": '["decoder_output", "pre_norm"]'}, "must give one of"),
        ({"sample_ids": json.dumps(["a", "b"])}, "metadata 'sample_ids' has 2 entries for 3 samples"),
        ({"finish_reasons": "{bad"}, "metadata 'finish_reasons' is not valid JSON"),
        ({"thinking": None}, "metadata key 'thinking' is missing"),
        ({"quality": json.dumps([{"flags": []}, {"flags": [1]}, {}])}, "'quality' must be a JSON list of objects"),
        ({"quality": json.dumps([{"flags": []}, {"flags": []}])}, "quality flags have 2 entries for 3 samples"),
        ({"dropped": json.dumps([{"id": 1, "flags": []}])}, "'dropped' must be a JSON list of objects with an 'id'"),
        ({"dropped": json.dumps({"id": "d"})}, "'dropped' must be a JSON list of objects with an 'id'"),
    ],
)
def test_inconsistent_shards_are_refused_with_where_and_what(tmp_path, changes, message):
    path = tmp_path / "s.safetensors"
    write_training_shard(path, SAMPLES, info())
    rewrite_metadata(path, **changes)
    with pytest.raises(ShardFormatError, match=message) as raised:
        ShardIndex.load(LocalFileSource(path))
    assert str(path) in str(raised.value)


def test_offsets_that_do_not_cover_the_tokens_are_refused(tmp_path):
    path = tmp_path / "s.safetensors"
    write_training_shard(path, SAMPLES, info())
    tensors = load_file(str(path))
    tensors["offsets"] = torch.tensor([0, 7, 5, 21])
    with safe_open(str(path), "pt") as handle:
        metadata = handle.metadata()
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(ShardFormatError, match="offsets decrease"):
        ShardIndex.load(LocalFileSource(path))
    tensors["offsets"] = torch.tensor([0, 7, 13, 20])
    save_file(tensors, str(path), metadata=metadata)
    with pytest.raises(ShardFormatError, match="offsets must run from 0 to 21 tokens"):
        ShardIndex.load(LocalFileSource(path))
