"""Where each tensor of a safetensors file lies, read from its header alone.

A safetensors file is an 8-byte little-endian header length N, N bytes of JSON (per tensor: dtype, shape,
[begin, end) byte offsets into the data that follows; plus string metadata), then the tensors' bytes, row-major.
Rows [a, b) of a tensor are therefore one contiguous byte range. The `safetensors` library needs a local file
to open; this module lets a reader fetch the header and then single rows from any storage with ranged reads.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass

import torch

from dflash_queue.errors import ShardFormatError

# Enough for the header of a shard of a few thousand samples in one read; a larger header costs a second read.
HEADER_PROBE_BYTES = 64 * 1024
# safetensors refuses headers above 100 MB; so do we, before allocating anything.
MAX_HEADER_BYTES = 100 * 1024 * 1024

TORCH_DTYPES: dict[str, torch.dtype] = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return TORCH_DTYPES[self.dtype]

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.itemsize

    def row_range(self, first: int, stop: int) -> tuple[int, int]:
        """(absolute start, length) of rows [first, stop) along the first axis."""
        if not 0 <= first <= stop <= self.shape[0]:
            raise IndexError(f"rows [{first}, {stop}) outside {self.name} with {self.shape[0]} rows")
        return self.begin + first * self.row_bytes, (stop - first) * self.row_bytes

    def decode_rows(self, raw: torch.Tensor, rows: int) -> torch.Tensor:
        """A uint8 buffer of `rows` whole rows -> a tensor of this dtype and shape [rows, ...]."""
        return raw.view(self.torch_dtype).reshape(rows, *self.shape[1:])


@dataclass(frozen=True)
class SafetensorsLayout:
    header_bytes: int  # N: the JSON header's length
    tensors: dict[str, TensorSpec]
    metadata: dict[str, str]

    @property
    def data_start(self) -> int:
        return 8 + self.header_bytes

    @property
    def file_size(self) -> int:
        return max((t.end for t in self.tensors.values()), default=self.data_start)

    def __getitem__(self, name: str) -> TensorSpec:
        return self.tensors[name]


def header_length(prefix: bytes, *, where: str) -> int:
    """N from the first 8 bytes, checked for sanity."""
    if len(prefix) < 8:
        raise ShardFormatError(f"{where}: {len(prefix)} bytes is too short for a safetensors file")
    (length,) = struct.unpack("<Q", prefix[:8])
    if length < 2 or length > MAX_HEADER_BYTES:
        raise ShardFormatError(f"{where}: header length {length} is not plausible; not a safetensors file")
    return length


def parse_header(header: bytes, *, where: str, file_size: int | None = None) -> SafetensorsLayout:
    """Parse and check the JSON header: dtypes known, sizes consistent with shapes, byte ranges packed back to
    back from the start of the data with no gap or overlap, and (when known) ending exactly at the file's end."""
    try:
        raw = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ShardFormatError(f"{where}: the safetensors header is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ShardFormatError(f"{where}: the safetensors header is not a JSON object")
    metadata = raw.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ShardFormatError(f"{where}: __metadata__ must map names to strings")
    data_start = 8 + len(header)
    tensors: dict[str, TensorSpec] = {}
    for name, entry in raw.items():
        tensors[name] = _tensor_spec(name, entry, data_start, where=where)
    ranges = sorted((t.begin, t.end, t.name) for t in tensors.values())
    cursor = data_start
    for begin, end, name in ranges:
        if begin != cursor:
            problem = "overlaps the previous tensor" if begin < cursor else f"leaves a gap of {begin - cursor} bytes"
            raise ShardFormatError(f"{where}: tensor {name!r} {problem}")
        cursor = end
    if file_size is not None and cursor != file_size:
        raise ShardFormatError(
            f"{where}: the header describes {cursor} bytes but the file holds {file_size} (truncated or padded)"
        )
    return SafetensorsLayout(len(header), tensors, dict(metadata))


def _tensor_spec(name: str, entry: object, data_start: int, *, where: str) -> TensorSpec:
    if not isinstance(entry, dict):
        raise ShardFormatError(f"{where}: tensor {name!r}: entry is not an object")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in TORCH_DTYPES:
        raise ShardFormatError(f"{where}: tensor {name!r}: unknown dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ShardFormatError(f"{where}: tensor {name!r}: bad shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise ShardFormatError(f"{where}: tensor {name!r}: bad data_offsets {offsets!r}")
    spec = TensorSpec(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])
    expected = math.prod(spec.shape) * spec.itemsize
    if spec.end - spec.begin != expected:
        raise ShardFormatError(
            f"{where}: tensor {name!r}: {spec.end - spec.begin} bytes for shape {list(shape)} {dtype} "
            f"(expected {expected})"
        )
    return spec
