"""Writing a training shard as its hidden states arrive, so that a writer never holds more than one sample.

Every tensor's size is known before extraction starts (token counts per sequence), so the file is laid out at
once: a reserved header region, then the tensors in safetensors' own order. Token ids, loss masks and offsets
are written at the start; each sequence's states go straight to their rows when they arrive (`write`), in any
order, in one write from their memory; `finish` writes the JSON header into the reserved region, padded with
spaces as the format allows. The states come with the statistics their engine checked them with (finite values
among them, see `training.check_summary`): the writer trusts them and does not read the states a second time.

Two cases need a second, streamed pass over the file (`_compacted`): sequences left out after all (a sample
isolated as the cause of an engine failure), and a header that outgrew its reservation (metadata known only
at the end, such as the canary's result). The copy goes row range by row range, never a whole tensor at once.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_queue.errors import ShardFormatError
from dflash_queue.shards.fp8 import FP8_DTYPE, FP8_NAME, SCALES_TENSOR, quantize_fp8
from dflash_queue.shards.training import ExtractedSample, ShardInfo, check_shape, check_summary, validate_sample
from dflash_queue.shards.verdicts import Verdict, quality_entry

STORAGE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, FP8_NAME: FP8_DTYPE}
SAFETENSORS_NAMES = {
    torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.float32: "F32",
    torch.bfloat16: "BF16", torch.float16: "F16", FP8_DTYPE: "F8_E4M3",
}
# Room left in the header for what is known only at the end (the canary's result, dead-lettered ids).
LATE_METADATA_BYTES = 16 * 1024
COPY_CHUNK_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class ShardRow:
    """One sequence of a shard, as known before its hidden states are computed."""

    id: str
    input_ids: torch.Tensor  # int [T]
    loss_mask: torch.Tensor  # uint8 [T]
    finish_reason: str
    thinking: bool
    quality: Verdict | None = None
    # When a sample is stored as one sequence per regenerated turn: the turn this sequence ends with.
    turn: int | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True)
class _Tensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # relative to the start of the data buffer

    @property
    def row_bytes(self) -> int:
        row = 1
        for size in self.shape[1:]:
            row *= size
        return row * torch.empty((), dtype=self.dtype).element_size()

    @property
    def nbytes(self) -> int:
        return self.shape[0] * self.row_bytes

    def entry(self) -> dict[str, Any]:
        return {
            "dtype": SAFETENSORS_NAMES[self.dtype],
            "shape": list(self.shape),
            "data_offsets": [self.begin, self.begin + self.nbytes],
        }


def _layout(num_tokens: int, num_rows: int, info: ShardInfo) -> dict[str, _Tensor]:
    """The tensors of a shard, placed as safetensors places them: wider dtypes first, then by name (which keeps
    every tensor aligned to its element size)."""
    width = (len(info.layer_ids), info.hidden_size)
    shapes: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
        "input_ids": (torch.int32, (num_tokens,)),
        "loss_mask": (torch.uint8, (num_tokens,)),
        "offsets": (torch.int64, (num_rows + 1,)),
        "hidden_states": (STORAGE_DTYPES[info.dtype], (num_tokens, *width)),
    }
    if info.dtype == FP8_NAME:
        shapes[SCALES_TENSOR] = (torch.float32, (num_tokens, width[0]))
    order = sorted(shapes, key=lambda name: (-torch.empty((), dtype=shapes[name][0]).element_size(), name))
    tensors, cursor = {}, 0
    for name in order:
        dtype, shape = shapes[name]
        tensors[name] = _Tensor(name, dtype, shape, cursor)
        cursor += tensors[name].nbytes
    return tensors


def _metadata(
    rows: Sequence[ShardRow],
    info: ShardInfo,
    dropped: Sequence[tuple[str, Verdict]],
    dead: Sequence[str],
    canary: dict[str, Any] | None,
) -> dict[str, str]:
    metadata = info.to_metadata()
    metadata["sample_ids"] = json.dumps([r.id for r in rows])
    metadata["finish_reasons"] = json.dumps([r.finish_reason for r in rows])
    metadata["thinking"] = json.dumps([r.thinking for r in rows])
    metadata["quality"] = json.dumps([quality_entry(r.quality) for r in rows])
    metadata["dropped"] = json.dumps([{"id": i, "flags": list(v.flags)} for i, v in dropped])
    metadata["dead_lettered"] = json.dumps(list(dead))
    if any(r.turn is not None for r in rows):
        # Rows of one sample, one per regenerated turn (the sample id repeats): the turn each row ends with.
        metadata["sample_turns"] = json.dumps([r.turn for r in rows])
    if canary is not None:
        metadata["canary"] = json.dumps(canary)
    return metadata


def _header(tensors: dict[str, _Tensor], metadata: dict[str, str]) -> bytes:
    header: dict[str, Any] = {"__metadata__": metadata}
    header.update({name: tensor.entry() for name, tensor in tensors.items()})
    return json.dumps(header, separators=(",", ":")).encode("utf-8")


def _reserved(header: bytes, extra: int) -> int:
    """Header region size: a multiple of 8, so that the data buffer starts aligned."""
    return -(-(len(header) + extra) // 8) * 8


class TrainingShardWriter:
    """One shard file, filled sequence by sequence. `rows` are every sequence that may be stored, in shard order.

    Use as a context manager (the file descriptor is closed however the block ends); `write(i, states)` for
    each row, then `finish(...)`. A row may be left out at `finish` without having been written.
    """

    def __init__(
        self,
        path: str | Path,
        rows: Sequence[ShardRow],
        info: ShardInfo,
        *,
        dropped: Sequence[tuple[str, Verdict]] = (),
        late_metadata_bytes: int = LATE_METADATA_BYTES,
    ) -> None:
        self.path = Path(path)
        self.rows = list(rows)
        self.info = info
        self.dropped = list(dropped)
        for row in self.rows:
            if row.loss_mask.shape[0] != row.num_tokens:
                raise ShardFormatError(f"sample {row.id}: loss_mask has {row.loss_mask.shape[0]} tokens, not {row.num_tokens}")
        self._starts = [0]
        for row in self.rows:
            self._starts.append(self._starts[-1] + row.num_tokens)
        self.tensors = _layout(self._starts[-1], len(self.rows), info)
        provisional = _header(self.tensors, _metadata(self.rows, info, self.dropped, (), None))
        self.header_bytes = _reserved(provisional, late_metadata_bytes)
        self._written: set[int] = set()
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        self._write_tokens(self._fd, self.tensors, self.header_bytes, self.rows)

    @property
    def data_start(self) -> int:
        return 8 + self.header_bytes

    def write(
        self, index: int, hidden_states: torch.Tensor, summary: torch.Tensor | None, *, replace: bool = False
    ) -> None:
        """Store one row's states, converted to the shard's dtype; `replace` writes over a row written already.
        `summary` is what the engine checked them with ([K, 3]: largest, smallest value, median token RMS per
        layer; see `check_summary`): the states are trusted as checked and not read again before they are written
        (their shape is checked)."""
        row = self.rows[index]
        check_shape(row.id, row.num_tokens, hidden_states, self.info)
        check_summary(row.id, summary, self.info)
        self._store(index, hidden_states, replace=replace)

    def _store(self, index: int, hidden_states: torch.Tensor, *, replace: bool = False) -> None:
        row = self.rows[index]
        if index in self._written and not replace:
            raise ShardFormatError(f"sample {row.id}: row {index} written twice")
        start = self._starts[index]
        if self.info.dtype == FP8_NAME:
            # Quantised row by row: a float32 copy of one sequence, never of the shard.
            quantized, scales = quantize_fp8(hidden_states)
            self._put(self._fd, self.data_start, self.tensors[SCALES_TENSOR], start, scales)
            self._put(self._fd, self.data_start, self.tensors["hidden_states"], start, quantized)
        else:
            # The states' bytes go from their memory to the file in one write (no copy when they are already
            # in the shard's dtype and contiguous).
            converted = hidden_states.to(STORAGE_DTYPES[self.info.dtype])
            self._put(self._fd, self.data_start, self.tensors["hidden_states"], start, converted)
        self._written.add(index)

    def finish(
        self,
        *,
        dead: Sequence[str] = (),
        canary: dict[str, Any] | None = None,
        leave_out: Iterable[int] = (),
    ) -> int:
        """Write the header (rows in `leave_out` are not in the shard); returns the file's size in bytes.

        `dead`: ids of samples left out because they alone made the engine fail (each has a dead letter). A shard
        may be empty only when every one of its samples was dropped by the quality gate or is dead."""
        left_out = set(leave_out)
        kept = [i for i in range(len(self.rows)) if i not in left_out]
        missing = [self.rows[i].id for i in kept if i not in self._written]
        if missing:
            raise ShardFormatError(f"no hidden states were written for {len(missing)} samples: {missing[:5]}")
        if not kept and not self.dropped and not dead:
            raise ShardFormatError("refusing to write an empty shard")
        rows = [self.rows[i] for i in kept]
        metadata = _metadata(rows, self.info, self.dropped, dead, canary)
        if left_out:
            return self._compacted(kept, metadata)
        header = _header(self.tensors, metadata)
        if len(header) > self.header_bytes:
            return self._compacted(kept, metadata)
        self._write_header(self._fd, header, self.header_bytes)
        size = self.data_start + sum(t.nbytes for t in self.tensors.values())
        os.ftruncate(self._fd, size)
        return size

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> TrainingShardWriter:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    # -- the rare path: a streamed copy into a new file -----------------------------------------------------

    def _compacted(self, kept: list[int], metadata: dict[str, str]) -> int:
        rows = [self.rows[i] for i in kept]
        tensors = _layout(sum(r.num_tokens for r in rows), len(rows), self.info)
        header = _header(tensors, metadata)
        header_bytes = _reserved(header, 0)
        target = self.path.with_name(self.path.name + ".compact")
        fd = os.open(target, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            self._write_tokens(fd, tensors, header_bytes, rows)
            copied = [name for name in ("hidden_states", SCALES_TENSOR) if name in tensors]
            destination = 0
            for index in kept:
                source, tokens = self._starts[index], self.rows[index].num_tokens
                for name in copied:
                    old, new = self.tensors[name], tensors[name]
                    _copy(
                        self._fd, self.data_start + old.begin + source * old.row_bytes,
                        fd, 8 + header_bytes + new.begin + destination * new.row_bytes,
                        tokens * old.row_bytes,
                    )
                destination += tokens
            self._write_header(fd, header, header_bytes)
            size = 8 + header_bytes + sum(t.nbytes for t in tensors.values())
            os.ftruncate(fd, size)
        except BaseException:
            os.close(fd)
            target.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(target, self.path)
        self.close()
        return size

    # -- writing ---------------------------------------------------------------------------------------------

    @classmethod
    def _write_tokens(cls, fd: int, tensors: dict[str, _Tensor], header_bytes: int, rows: Sequence[ShardRow]) -> None:
        data_start = 8 + header_bytes
        lengths = torch.tensor([r.num_tokens for r in rows], dtype=torch.int64)
        offsets = torch.zeros(len(rows) + 1, dtype=torch.int64)
        offsets[1:] = torch.cumsum(lengths, 0)
        cls._put(fd, data_start, tensors["offsets"], 0, offsets)
        if rows:
            cls._put(fd, data_start, tensors["input_ids"], 0, torch.cat([r.input_ids.to(torch.int32) for r in rows]))
            cls._put(fd, data_start, tensors["loss_mask"], 0, torch.cat([r.loss_mask.to(torch.uint8) for r in rows]))

    @staticmethod
    def _write_header(fd: int, header: bytes, header_bytes: int) -> None:
        padded = header + b" " * (header_bytes - len(header))
        _pwrite_all(fd, header_bytes.to_bytes(8, "little") + padded, 0)

    @staticmethod
    def _put(fd: int, data_start: int, tensor: _Tensor, first_row: int, values: torch.Tensor) -> None:
        if values.dtype != tensor.dtype:
            raise ShardFormatError(f"{tensor.name}: {values.dtype} values for a {tensor.dtype} tensor")
        raw = values.contiguous().reshape(-1).view(torch.uint8)
        _pwrite_all(fd, raw.numpy().data, data_start + tensor.begin + first_row * tensor.row_bytes)


def write_training_shard(
    path: str | Path,
    samples: Sequence[ExtractedSample],
    info: ShardInfo,
    *,
    dropped: Sequence[tuple[str, Verdict]] = (),
    dead: Sequence[str] = (),
    canary: dict[str, Any] | None = None,
) -> int:
    """Write a shard of samples already in memory (every sample is checked, its states value by value, before the
    file is created); returns its size in bytes."""
    for sample in samples:
        validate_sample(sample, info)
    rows = [
        ShardRow(s.id, s.input_ids, s.loss_mask, s.finish_reason, s.thinking, s.quality, s.turn) for s in samples
    ]
    with TrainingShardWriter(path, rows, info, dropped=dropped) as writer:
        for index, sample in enumerate(samples):
            writer._store(index, sample.hidden_states)
        return writer.finish(dead=dead, canary=canary)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view, done = memoryview(data).cast("B"), 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def _copy(source: int, source_offset: int, target: int, target_offset: int, length: int) -> None:
    done = 0
    while done < length:
        chunk = os.pread(source, min(COPY_CHUNK_BYTES, length - done), source_offset + done)
        if not chunk:
            raise ShardFormatError(f"shard file ends at byte {source_offset + done} during compaction")
        _pwrite_all(target, chunk, target_offset + done)
        done += len(chunk)
