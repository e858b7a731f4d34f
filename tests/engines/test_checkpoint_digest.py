"""The weights' digest tells another checkpoint behind the same path and name (a fine-tune) from the one a run was
made with, reading a few MB of each file: checked on the tiny model's real checkpoint, a fine-tune of it and the
same weights sharded with an index."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from dflash_queue.engines import checkpoint_digest
from dflash_queue.engines.checkpoint_digest import CHUNK, INDEX, SAMPLES, sample_offsets, weights_digest
from dflash_queue.errors import ConfigError
from dfq_testing.checkpoints import fine_tune, sharded


def header_bytes(path: Path) -> bytes:
    data = path.read_bytes()
    return data[: 8 + int.from_bytes(data[:8], "little")]


@pytest.fixture
def counted_reads(monkeypatch) -> list[int]:
    """The bytes of each read the digest makes (its file digests forgotten first, so that it reads)."""
    reads: list[int] = []
    pread = os.pread

    def counting(fd: int, length: int, offset: int) -> bytes:
        data = pread(fd, length, offset)
        reads.append(len(data))
        return data

    checkpoint_digest._file_digest.cache_clear()
    monkeypatch.setattr(checkpoint_digest.os, "pread", counting)
    return reads


def test_a_fine_tune_has_other_weights_and_a_copy_the_same_reading_a_sample_of_each_file(
    tiny_model, tmp_path, counted_reads
):
    weights = tiny_model / "model.safetensors"
    assert weights.stat().st_size > 8 + len(header_bytes(weights)) + SAMPLES * CHUNK  # sampled, not read whole
    original = weights_digest(tiny_model)
    header = header_bytes(weights)
    assert sum(counted_reads) == len(header) + SAMPLES * CHUNK  # its 8 length bytes, header and samples only
    assert original is not None and len(original) == 16

    copy = shutil.copytree(tiny_model, tmp_path / "copy")
    assert weights_digest(copy) == original  # its contents, not its path or times

    tuned = fine_tune(tiny_model, tmp_path / "fine-tune")
    tuned_weights = tuned / "model.safetensors"
    # What the config digest and the file listing see is the same: config, names, shapes, dtypes, sizes.
    assert (tuned / "config.json").read_bytes() == (tiny_model / "config.json").read_bytes()
    assert header_bytes(tuned_weights) == header and tuned_weights.stat().st_size == weights.stat().st_size
    assert weights_digest(tuned) != original

    # The same checkpoint rewritten in place behind the path: a process that read it before reads it again.
    fine_tune(copy)
    assert weights_digest(copy) == weights_digest(tuned)
    # Written into the same file and given back its modification time (`cp -p` over it): read again too.
    same_file = shutil.copytree(tiny_model, tmp_path / "same-file") / "model.safetensors"
    assert weights_digest(same_file.parent) == original
    before = same_file.stat()
    with open(same_file, "r+b") as file:
        file.write(tuned_weights.read_bytes())
    os.utime(same_file, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = same_file.stat()
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (before.st_ino, before.st_size, before.st_mtime_ns)
    assert weights_digest(same_file.parent) == weights_digest(tuned)


def test_a_sharded_checkpoint_is_digested_over_the_files_its_index_names(tiny_model, tmp_path):
    shards = sharded(tiny_model, tmp_path / "sharded", 3)
    files = sorted(p.name for p in shards.glob("*.safetensors"))
    assert len(files) == 3
    digest = weights_digest(shards)
    assert digest is not None and digest != weights_digest(tiny_model)  # other files: other weights

    # One shard of three fine-tuned is another checkpoint.
    assert weights_digest(fine_tune(shards, tmp_path / "one-tuned", files=[files[1]])) != digest
    # A safetensors file its index does not name is not part of it (the loaders do not read it).
    shutil.copy(shards / files[0], shards / "consolidated.safetensors")
    assert weights_digest(shards) == digest

    # A shard missing: an incomplete checkpoint, named.
    partial = shutil.copytree(shards, tmp_path / "partial")
    (partial / files[2]).unlink()
    with pytest.raises(ConfigError, match=rf"incomplete checkpoint: its {INDEX} names 3 weight files, 1 of them "
                       rf"missing \({files[2]}\)"):
        weights_digest(partial)

    # The config and tokenizer files only, its index with them (a node of inference servers): no weights.
    weightless = shutil.copytree(shards, tmp_path / "weightless", ignore=shutil.ignore_patterns("*.safetensors"))
    assert (weightless / INDEX).is_file() and weights_digest(weightless) is None
    (weightless / INDEX).unlink()
    assert weights_digest(weightless) is None
    assert weights_digest(tmp_path / "no-such-directory") is None


def test_a_file_that_is_not_safetensors_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 64)
    with pytest.raises(ConfigError, match=r"model.safetensors: not a safetensors file"):
        weights_digest(tmp_path)


def test_samples_cover_the_tensor_data_evenly_from_its_first_byte_to_its_last():
    start, size = 1000, 1000 + 10 * SAMPLES * CHUNK + 7
    reads = sample_offsets(start, size)
    assert len(reads) == SAMPLES and {length for _, length in reads} == {CHUNK}
    assert reads[0][0] == start and reads[-1][0] + CHUNK == size
    gaps = {b[0] - a[0] for a, b in zip(reads, reads[1:])}
    assert max(gaps) - min(gaps) <= 1
    # Data no larger than the samples is read whole.
    small = sample_offsets(start, start + 3 * CHUNK + 5)
    assert small == [(start, CHUNK), (start + CHUNK, CHUNK), (start + 2 * CHUNK, CHUNK), (start + 3 * CHUNK, 5)]
