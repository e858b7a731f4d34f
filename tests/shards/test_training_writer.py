"""The streamed shard writer against safetensors' own `save_file` of the same tensors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_queue.engines.passes import summarize, token_stats
from dflash_queue.errors import NonFiniteRowRefused, ShardFormatError
from dflash_queue.shards.fp8 import FP8_NAME, SCALES_TENSOR, quantize_fp8
from dflash_queue.shards.layout import header_length, parse_header
from dflash_queue.shards.training import ShardInfo, TrainingShard
from dflash_queue.shards.training_writer import ShardRow, TrainingShardWriter
from dflash_queue.shards.verdicts import Verdict, quality_entry
from dflash_queue.training.dataset import ShardDataset

K, H = 3, 16


def checked(states: torch.Tensor) -> torch.Tensor:
    """The summary an engine hands over with the states it checked."""
    return summarize(token_stats(states))


def info(dtype: str) -> ShardInfo:
    return ShardInfo(
        target_model="tiny",
        layer_ids=(0, 2, 4),
        num_model_layers=6,
        hidden_size=H,
        dtype=dtype,
        config_fingerprint="abc",
        versions={"torch": torch.__version__},
    )


def rows_and_states(count: int, seed: int = 0) -> tuple[list[ShardRow], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    rows, states = [], []
    for i in range(count):
        prompt, completion = 2 + i % 3, 3 + (i * 5) % 7
        tokens = prompt + completion
        rows.append(
            ShardRow(
                id=f"s{i // 2}",  # two rows per sample: one sequence per regenerated turn
                input_ids=torch.randint(0, 1000, (tokens,), generator=gen, dtype=torch.int32),
                loss_mask=torch.cat([torch.zeros(prompt, dtype=torch.uint8), torch.ones(completion, dtype=torch.uint8)]),
                finish_reason="stop" if i % 3 else "length",
                thinking=bool(i % 2),
                quality=Verdict(flags=("loop",)) if i == 1 else None,
                turn=i % 2,
            )
        )
        # float32 as the model computes them, with a wide range so that the fp8 scales differ per token.
        states.append(torch.randn(tokens, K, H, generator=gen) * torch.logspace(-3, 3, tokens).view(-1, 1, 1))
    return rows, states


def reference_shard(path: Path, rows, states, dtype: str, *, dropped=(), dead=(), canary=None) -> None:
    """The shard as the writer before streaming made it: whole tensors concatenated, saved by safetensors."""
    lengths = torch.tensor([r.num_tokens for r in rows], dtype=torch.int64)
    offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
    offsets[1:] = torch.cumsum(lengths, 0)
    tensors = {
        "input_ids": torch.cat([r.input_ids for r in rows]) if rows else torch.zeros(0, dtype=torch.int32),
        "loss_mask": torch.cat([r.loss_mask for r in rows]) if rows else torch.zeros(0, dtype=torch.uint8),
        "offsets": offsets,
    }
    hidden = states or [torch.zeros(0, K, H)]
    if dtype == FP8_NAME:
        quantized = [quantize_fp8(h) for h in hidden]
        tensors["hidden_states"] = torch.cat([q for q, _ in quantized])
        tensors[SCALES_TENSOR] = torch.cat([s for _, s in quantized])
    else:
        tensors["hidden_states"] = torch.cat([h.to(getattr(torch, dtype)) for h in hidden])
    metadata = info(dtype).to_metadata() | {
        "sample_ids": json.dumps([r.id for r in rows]),
        "finish_reasons": json.dumps([r.finish_reason for r in rows]),
        "thinking": json.dumps([r.thinking for r in rows]),
        "quality": json.dumps([quality_entry(r.quality) for r in rows]),
        "dropped": json.dumps([{"id": i, "flags": list(v.flags)} for i, v in dropped]),
        "dead_lettered": json.dumps(list(dead)),
    }
    if rows:
        metadata["sample_turns"] = json.dumps([r.turn for r in rows])
    if canary is not None:
        metadata["canary"] = json.dumps(canary)
    save_file(tensors, str(path), metadata=metadata)


def assert_same_shard(got: Path, expected: Path) -> None:
    with safe_open(str(got), "pt") as a, safe_open(str(expected), "pt") as b:
        assert a.metadata() == b.metadata()
        assert sorted(a.keys()) == sorted(b.keys())
        for name in b.keys():
            x, y = a.get_tensor(name), b.get_tensor(name)
            assert x.dtype == y.dtype and x.shape == y.shape, name
            assert torch.equal(x.view(torch.uint8), y.view(torch.uint8)), name  # bit for bit, fp8 included
    # Every tensor where the header says, tiling the data exactly (no gap, nothing after the last tensor).
    raw = got.read_bytes()
    length = header_length(raw[:8], where=str(got))
    parse_header(raw[8 : 8 + length], where=str(got), file_size=len(raw))
    assert (8 + length) % 8 == 0
    ours, theirs = TrainingShard(got), TrainingShard(expected)
    assert ours.sample_ids == theirs.sample_ids and torch.equal(ours.offsets, theirs.offsets)
    for index in range(len(theirs)):
        x, y = ours[index], theirs[index]
        assert torch.equal(x.hidden_states, y.hidden_states) and torch.equal(x.input_ids, y.input_ids)
        assert x.flags == y.flags and x.finish_reason == y.finish_reason


@pytest.mark.parametrize("dtype", ["bfloat16", "float32", FP8_NAME])
def test_streamed_shard_holds_what_save_file_of_the_whole_tensors_holds(tmp_path, dtype):
    rows, states = rows_and_states(9)
    canary = {"samples": ["s1"], "relative_error": 1e-6, "relative_error_per_layer": [1e-6] * K}
    dropped = [("gone", Verdict(flags=("stub",)))]
    path = tmp_path / "streamed.safetensors"
    with TrainingShardWriter(path, rows, info(dtype), dropped=dropped) as writer:
        for index in [4, 0, 8, 2, 1, 3, 7, 5, 6]:  # passes finish in any order
            writer.write(index, states[index], checked(states[index]))
        size = writer.finish(canary=canary)
    assert size == path.stat().st_size
    reference_shard(tmp_path / "ref.safetensors", rows, states, dtype, dropped=dropped, canary=canary)
    assert_same_shard(path, tmp_path / "ref.safetensors")
    assert json.loads(TrainingShard(path).info()["canary"]) == canary

    dataset = ShardDataset(str(tmp_path), keys=["streamed.safetensors"], hidden_dtype=torch.float32)
    reference = ShardDataset(str(tmp_path), keys=["ref.safetensors"], hidden_dtype=torch.float32)
    assert len(dataset) == len(reference) == 9
    for number in range(9):
        assert torch.equal(dataset[number]["hidden_states"], reference[number]["hidden_states"])
        assert torch.equal(dataset[number]["loss_mask"], reference[number]["loss_mask"])


@pytest.mark.parametrize("dtype", ["bfloat16", FP8_NAME])
def test_left_out_rows_are_compacted_away(tmp_path, dtype):
    """Rows of a sample isolated as poison: one was written before its sample died, one never was."""
    rows, states = rows_and_states(8)
    path = tmp_path / "streamed.safetensors"
    with TrainingShardWriter(path, rows, info(dtype)) as writer:
        for index in (0, 1, 2, 4, 5, 6, 7):
            writer.write(index, states[index], checked(states[index]))
        writer.finish(dead=["s1"], leave_out=[2, 3])
    assert list(tmp_path.iterdir()) == [path]  # the compacted copy replaced the file
    kept = [0, 1, 4, 5, 6, 7]
    reference_shard(
        tmp_path / "ref.safetensors", [rows[i] for i in kept], [states[i] for i in kept], dtype, dead=["s1"]
    )
    assert_same_shard(path, tmp_path / "ref.safetensors")


def test_metadata_larger_than_the_reserved_header_is_written_by_a_copy(tmp_path):
    rows, states = rows_and_states(4)
    canary = {"samples": [f"sample-{i}" for i in range(200)], "relative_error": 0.0}
    path = tmp_path / "streamed.safetensors"
    with TrainingShardWriter(path, rows, info("bfloat16"), late_metadata_bytes=64) as writer:
        for index, hidden in enumerate(states):
            writer.write(index, hidden, checked(hidden))
        writer.finish(canary=canary)
    reference_shard(tmp_path / "ref.safetensors", rows, states, "bfloat16", canary=canary)
    assert_same_shard(path, tmp_path / "ref.safetensors")


@pytest.mark.parametrize("dtype", ["float32", FP8_NAME])
def test_a_shard_with_every_sample_dropped_or_dead_is_empty_but_well_formed(tmp_path, dtype):
    path = tmp_path / "streamed.safetensors"
    dropped = [("a", Verdict(flags=("stub",)))]
    with TrainingShardWriter(path, [], info(dtype), dropped=dropped) as writer:
        writer.finish(dead=["b"])
    reference_shard(tmp_path / "ref.safetensors", [], [], dtype, dropped=dropped, dead=["b"])
    assert_same_shard(path, tmp_path / "ref.safetensors")
    assert len(TrainingShard(path)) == 0

    rows, states = rows_and_states(2)
    with TrainingShardWriter(tmp_path / "dead.safetensors", rows, info(dtype)) as writer:
        writer.write(0, states[0], checked(states[0]))
        writer.finish(dead=["s0"], leave_out=[0, 1])
    reference_shard(tmp_path / "ref-dead.safetensors", [], [], dtype, dead=["s0"])
    assert_same_shard(tmp_path / "dead.safetensors", tmp_path / "ref-dead.safetensors")


def test_refusals(tmp_path):
    rows, states = rows_and_states(3)
    with TrainingShardWriter(tmp_path / "a.safetensors", rows, info("bfloat16")) as writer:
        for bad_value in (float("inf"), float("-inf"), float("nan")):
            bad = states[1].clone()
            bad[0, 1, 2] = bad_value
            with pytest.raises(NonFiniteRowRefused, match="sample s0: hidden states contain NaN or Inf"):
                writer.write(1, bad, checked(bad))
        with pytest.raises(ShardFormatError, match=r"hidden_states shape .* expected"):
            writer.write(0, states[0][:, :2], checked(states[0][:, :2]))
        # States without the statistics they were checked with are refused, not read.
        with pytest.raises(ShardFormatError, match=r"sample s0: hidden states handed to the shard writer without the "
                           r"engine's statistics \(a \(3, 3\) float summary; got None\)"):
            writer.write(0, states[0], None)
        with pytest.raises(ShardFormatError, match=r"without the engine's statistics .* got \(5, 3, 3\)"):
            writer.write(0, states[0], token_stats(states[0]))
        writer.write(0, states[0], checked(states[0]))
        with pytest.raises(ShardFormatError, match="written twice"):
            writer.write(0, states[0], checked(states[0]))
        with pytest.raises(ShardFormatError, match="no hidden states were written for 2 samples"):
            writer.finish()
    with TrainingShardWriter(tmp_path / "b.safetensors", [], info("bfloat16")) as writer:
        with pytest.raises(ShardFormatError, match="refusing to write an empty shard"):
            writer.finish()
    short = ShardRow("x", rows[0].input_ids, rows[0].loss_mask[:-1], "stop", False)
    with pytest.raises(ShardFormatError, match="loss_mask has"):
        TrainingShardWriter(tmp_path / "c.safetensors", [short], info("bfloat16"))
