"""A checkpoint's weights told apart cheaply: a digest of its safetensors files that tells another checkpoint behind
the same path and name (a fine-tune: the same `config.json`, tensor names, shapes and file sizes, other bytes) from
the one a run was made with, without reading the whole checkpoint.

The files are those `model.safetensors.index.json` names (what the loaders read), else every `*.safetensors` in the
directory. Each enters with its name, its size, its whole header (tensor names, dtypes, shapes, offsets, metadata)
and `SAMPLES` reads of `CHUNK` bytes spread evenly over its tensor data, its first and last bytes included: 4 MiB
a file whatever its size (a file with less tensor data than that is read whole). A fine-tune changes every tensor's
bytes, so any sample tells it apart; one that changed only a part of the weights (a few projections, a LoRA merged
into some) is told apart unless it changed none of the 64 places sampled in any of its files.

The digest depends on the files' contents only (not on their paths, times or the machine), so every node holding
the checkpoint computes the same one. The same weights sharded otherwise or saved with other metadata count as
other weights. A directory without safetensors weights (a node that serves the tokenizer and config only, whose
index may be there without its files) has none: `None`.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from dflash_queue.errors import ConfigError

INDEX = "model.safetensors.index.json"
# Reads of tensor data per file, and their size: SAMPLES * CHUNK bytes a file (4 MiB) besides its header.
SAMPLES = 64
CHUNK = 64 * 1024
# A safetensors header's length is a little-endian u64 before it; the format caps it at 100 MB.
_HEADER_LENGTH_BYTES = 8
_MAX_HEADER = 100_000_000


def weights_digest(model_path: str | os.PathLike[str]) -> str | None:
    """A short digest of the checkpoint's safetensors weights in `model_path`; None when it holds none. A checkpoint
    whose index names files that are not all there, or whose files are not safetensors, is a ConfigError."""
    directory = Path(model_path)
    files = weight_files(directory)
    if not files:
        return None
    digest = hashlib.sha256()
    for file in files:
        stat = file.stat()
        file_digest = _file_digest(str(file), stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino, stat.st_dev)
        digest.update(f"{file.relative_to(directory).as_posix()}\0{file_digest}\0".encode())
    return digest.hexdigest()[:16]


def weight_files(directory: Path) -> list[Path]:
    """The checkpoint's safetensors files, sorted by name: those its index names, else all in the directory. None of
    the indexed files present is a directory without weights ([]); some of them only, an incomplete checkpoint."""
    index = directory / INDEX
    if not index.is_file():
        return sorted(p for p in directory.glob("*.safetensors") if p.is_file()) if directory.is_dir() else []
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigError(f"{index}: unreadable checkpoint index ({type(exc).__name__}: {exc})") from None
    present = [directory / name for name in names if (directory / name).is_file()]
    if present and len(present) < len(names):
        missing = sorted(set(names) - {p.name for p in present})
        raise ConfigError(
            f"{directory}: an incomplete checkpoint: its {INDEX} names {len(names)} weight files, "
            f"{len(missing)} of them missing ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''})"
        )
    return present


def sample_offsets(data_start: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) of the reads that stand for the tensor data from `data_start` to `size`: all of it in
    CHUNK-byte reads when it is no larger than SAMPLES reads, else SAMPLES reads spread evenly from its first byte
    to its last."""
    data = size - data_start
    if data <= SAMPLES * CHUNK:
        return [(start, min(CHUNK, size - start)) for start in range(data_start, size, CHUNK)]
    step = data - CHUNK
    return [(data_start + i * step // (SAMPLES - 1), CHUNK) for i in range(SAMPLES)]


# Keyed by what tells a file replaced or rewritten (size, inode, modification time, and the change time, which a copy
# that keeps the source's modification time still moves): a process asks for the digest of one checkpoint several
# times (a run's identity, the config it is compared with) and reads it once.
@functools.lru_cache(maxsize=1024)
def _file_digest(path: str, size: int, mtime_ns: int, ctime_ns: int, inode: int, device: int) -> str:
    digest = hashlib.sha256(size.to_bytes(8, "little"))
    fd = os.open(path, os.O_RDONLY)
    try:
        length_bytes = os.pread(fd, _HEADER_LENGTH_BYTES, 0)
        header_length = int.from_bytes(length_bytes, "little") if len(length_bytes) == _HEADER_LENGTH_BYTES else -1
        if not 0 < header_length <= min(_MAX_HEADER, size - _HEADER_LENGTH_BYTES):
            raise ConfigError(
                f"{path}: not a safetensors file (its first 8 bytes give a header of {header_length} bytes; "
                f"the file has {size})"
            )
        data_start = _HEADER_LENGTH_BYTES + header_length
        digest.update(os.pread(fd, header_length, _HEADER_LENGTH_BYTES))
        for offset, length in sample_offsets(data_start, size):
            digest.update(os.pread(fd, length, offset))
    finally:
        os.close(fd)
    return digest.hexdigest()
