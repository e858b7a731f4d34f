from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.layout import TORCH_DTYPES, header_length, parse_header
from dflash_queue.shards.ranges import LocalFileSource, read_layout


def all_dtypes(path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        f"t_{name.lower()}": (torch.randn(7, 3, 5, generator=gen) * 10).to(dtype)
        for name, dtype in TORCH_DTYPES.items()
    }
    save_file(tensors, str(path), metadata={"k": "v"})
    return tensors


def test_rows_read_by_range_equal_safetensors_slices(tmp_path):
    path = tmp_path / "all.safetensors"
    tensors = all_dtypes(path)
    source = LocalFileSource(path)
    layout = read_layout(source)
    assert layout.metadata == {"k": "v"} and set(layout.tensors) == set(tensors)
    assert layout.file_size == path.stat().st_size
    with safe_open(str(path), "pt") as handle:
        for name, spec in layout.tensors.items():
            for first, stop in ((0, 7), (2, 5), (6, 7), (3, 3)):
                got = spec.decode_rows(source.read(*spec.row_range(first, stop)), stop - first)
                want = handle.get_slice(name)[first:stop]
                assert got.dtype == want.dtype and got.shape == want.shape
                assert torch.equal(got.view(torch.uint8), want.contiguous().view(torch.uint8)), name
    with pytest.raises(IndexError):
        layout["t_f32"].row_range(5, 8)


def header_of(path):
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    return data, json.loads(data[8 : 8 + length])


def rewrite(path, header, body):
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + body)


@pytest.fixture
def small(tmp_path):
    path = tmp_path / "s.safetensors"
    save_file({"a": torch.arange(6, dtype=torch.int32), "b": torch.ones(2, 2, dtype=torch.float32)}, str(path))
    return path


def test_truncated_file_is_refused(small):
    data = small.read_bytes()
    small.write_bytes(data[:-3])
    with pytest.raises(ShardFormatError, match="truncated or padded"):
        read_layout(LocalFileSource(small))


def test_overlapping_and_gapped_tensors_are_refused(small):
    data, header = header_of(small)
    body = data[8 + struct.unpack("<Q", data[:8])[0]:]
    header["a"]["data_offsets"] = [4, 28]  # overlaps b at [0, 16)
    rewrite(small, header, body + b"\0" * 4)
    with pytest.raises(ShardFormatError, match="overlaps"):
        read_layout(LocalFileSource(small))
    _, header = header_of(small)
    header["a"]["data_offsets"] = [20, 44]
    rewrite(small, header, body + b"\0" * 4)
    with pytest.raises(ShardFormatError, match="gap of 4 bytes"):
        read_layout(LocalFileSource(small))


def test_size_not_matching_shape_and_unknown_dtype_are_refused(small):
    data, header = header_of(small)
    body = data[8 + struct.unpack("<Q", data[:8])[0]:]
    header["a"]["shape"] = [5]
    rewrite(small, header, body)
    with pytest.raises(ShardFormatError, match="tensor 'a': 24 bytes for shape \\[5\\] I32 \\(expected 20\\)"):
        read_layout(LocalFileSource(small))
    header["a"]["shape"] = [6]
    header["a"]["dtype"] = "Q4"
    rewrite(small, header, body)
    with pytest.raises(ShardFormatError, match="unknown dtype 'Q4'"):
        read_layout(LocalFileSource(small))


def test_garbage_is_refused_before_allocating(tmp_path):
    path = tmp_path / "g.safetensors"
    path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(ShardFormatError, match="not plausible"):
        read_layout(LocalFileSource(path))
    with pytest.raises(ShardFormatError, match="too short"):
        header_length(b"\x01\x02", where="x")
    with pytest.raises(ShardFormatError, match="not valid JSON"):
        parse_header(b"{oops", where="x")


def test_a_header_larger_than_the_probe_costs_a_second_read(tmp_path):
    path = tmp_path / "big-header.safetensors"
    save_file({"a": torch.zeros(3)}, str(path), metadata={"blob": "x" * 200_000})
    layout = read_layout(LocalFileSource(path))
    assert layout.metadata["blob"] == "x" * 200_000 and layout["a"].shape == (3,)
