"""TrainingShard: one local shard file sample by sample, read through the strict reader (`ShardIndex`)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.fp8 import SCALES_TENSOR
from dflash_queue.shards.ranges import LocalFileSource
from dflash_queue.shards.reader import ShardIndex
from dflash_queue.shards.training import ExtractedSample, ShardInfo, TrainingShard
from dflash_queue.shards.training_writer import write_training_shard
from dflash_queue.shards.verdicts import Verdict


def info(dtype: str = "bfloat16") -> ShardInfo:
    return ShardInfo("tiny", (1, 3), 6, 8, dtype, "abc", {"torch": torch.__version__})


def extracted(name: str, prompt: int, completion: int, seed: int, flags: tuple[str, ...] = ()) -> ExtractedSample:
    gen = torch.Generator().manual_seed(seed)
    tokens = prompt + completion
    return ExtractedSample(
        id=name,
        input_ids=torch.randint(0, 100, (tokens,), generator=gen, dtype=torch.int32),
        loss_mask=torch.cat([torch.zeros(prompt, dtype=torch.uint8), torch.ones(completion, dtype=torch.uint8)]),
        hidden_states=torch.randn(tokens, 2, 8, generator=gen) * 10,
        finish_reason="length" if seed == 1 else "stop",
        thinking=seed != 2,
        quality=Verdict(flags=flags, answer_tokens=completion, thinking="closed"),
    )


SAMPLES = [extracted("a", 3, 4, 0), extracted("b", 5, 1, 1, flags=("loop",)), extracted("c", 2, 6, 2)]
DROPPED = [("gone", Verdict(decision="drop", flags=("stub",)))]


def write(path, dtype: str = "bfloat16") -> None:
    write_training_shard(path, SAMPLES, info(dtype), dropped=DROPPED, dead=["dead"], canary={"samples": ["a"]})


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "fp8_e4m3"])
def test_the_view_gives_what_safetensors_reads_as_stored(tmp_path, dtype):
    path = tmp_path / "s.safetensors"
    write(path, dtype)
    shard = TrainingShard(path)
    with safe_open(str(path), "pt") as handle:
        meta = handle.metadata()
        stored = {name: handle.get_tensor(name) for name in handle.keys()}
    assert shard.sample_ids == ["a", "b", "c"] and shard.finish_reasons == ["stop", "length", "stop"]
    assert shard.thinking == [True, True, False] and shard.layer_ids == [1, 3] and shard.num_tokens == 21
    assert shard.quality == json.loads(meta["quality"]) and shard.quality[1]["answer_tokens"] == 1
    assert shard.dropped == [{"id": "gone", "flags": ["stub"]}]
    assert shard.info()["dtype"] == dtype and json.loads(shard.info()["canary"]) == {"samples": ["a"]}
    assert not {"sample_ids", "quality", "dropped", "dead_lettered"} & shard.info().keys()
    offsets = stored["offsets"]
    for index, sample in enumerate(shard):
        rows = slice(int(offsets[index]), int(offsets[index + 1]))
        assert sample.id == SAMPLES[index].id and sample.flags == SAMPLES[index].quality.flags
        assert sample.input_ids.dtype == torch.int32 and torch.equal(sample.input_ids, stored["input_ids"][rows])
        assert sample.loss_mask.dtype == torch.uint8 and torch.equal(sample.loss_mask, stored["loss_mask"][rows])
        states = stored["hidden_states"][rows]
        if SCALES_TENSOR in stored:  # fp8: dequantised with its per-token scales, in bfloat16
            states = (states.float() * stored[SCALES_TENSOR][rows].unsqueeze(-1)).to(torch.bfloat16)
        assert sample.hidden_states.dtype == states.dtype and torch.equal(sample.hidden_states, states)
    assert shard.loss_mask_sums() == [4, 1, 6]
    with pytest.raises(IndexError):
        shard[3]


def damage(path, *, dtype: str = "bfloat16", metadata: dict | None = None, tensors: dict | None = None,
           drop: tuple[str, ...] = ()) -> None:
    """A shard as written, then saved again by safetensors with metadata or tensors changed."""
    write(path, dtype)
    values = load_file(str(path))
    with safe_open(str(path), "pt") as handle:
        meta = dict(handle.metadata())
    meta.update(metadata or {})
    values.update(tensors or {})
    for name in drop:
        del values[name]
    save_file(values, str(path), metadata=meta)


# Shards the view accepted when it parsed the file itself (each of its samples read without an error), and the
# strict reader's word on them.
ONCE_ACCEPTED = {
    "states stored in another dtype than the metadata says": (
        {"metadata": {"dtype": "float32"}}, "tensor 'hidden_states' is BF16, expected F32"),
    "more layer ids than stored layers": (
        {"metadata": {"layer_ids": "[1, 2, 3]"}}, r"'hidden_states' has shape \[21, 2, 8\], expected \[21, 3, 8\]"),
    "a hidden size the states do not have": (
        {"metadata": {"hidden_size": "16"}}, r"'hidden_states' has shape \[21, 2, 8\], expected \[21, 2, 16\]"),
    "states for fewer tokens than the ids": (
        {"tensors": {"hidden_states": torch.zeros(20, 2, 8, dtype=torch.bfloat16)}},
        r"'hidden_states' has shape \[20, 2, 8\], expected \[21, 2, 8\]"),
    "offsets that decrease": ({"tensors": {"offsets": torch.tensor([0, 7, 5, 21])}}, "offsets decrease"),
    "offsets short of the last token": (
        {"tensors": {"offsets": torch.tensor([0, 7, 13, 20])}}, "offsets must run from 0 to 21 tokens"),
    "an entry kind no engine writes": (
        {"metadata": {"layer_states": '["decoder_output", "pre_norm"]'}}, "layer_states .* must give one of"),
    "thinking that is not true or false": (
        {"metadata": {"thinking": '["yes", "no", "yes"]'}}, "'thinking' must be a JSON list of bool"),
    "quality flags that are not names": (
        {"metadata": {"quality": json.dumps([{"flags": [1]}] * 3)}}, "'quality' must be a JSON list of objects"),
    "a dropped sample without an id": (
        {"metadata": {"dropped": json.dumps([{"flags": ["stub"]}])}}, "'dropped' must be a JSON list of objects"),
    "a dtype no writer writes": ({"metadata": {"dtype": "int4"}}, "metadata dtype 'int4' is not one of"),
}


@pytest.mark.parametrize("what", ONCE_ACCEPTED)
def test_a_shard_the_strict_reader_refuses_is_refused_by_the_view(tmp_path, what):
    changes, message = ONCE_ACCEPTED[what]
    path = tmp_path / "s.safetensors"
    damage(path, **changes)
    with pytest.raises(ShardFormatError, match=message):
        ShardIndex.load(LocalFileSource(path))
    with pytest.raises(ShardFormatError, match=message) as raised:
        TrainingShard(path)
    assert str(path) in str(raised.value)


def test_an_fp8_shard_without_its_scales_is_refused_when_opened(tmp_path):
    path = tmp_path / "s.safetensors"
    damage(path, dtype="fp8_e4m3", drop=(SCALES_TENSOR,))
    with pytest.raises(ShardFormatError, match=r"missing tensors \['hidden_scales'\]"):
        TrainingShard(path)
