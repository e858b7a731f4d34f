"""The forward passes of the extract engine: which sequences share one, its inputs, and the per-token statistics
its captured states are checked with.

* packed: the sequences concatenated in one row, position ids restarting per sequence, and their offsets
  (cu_seqlens) for the token mixers that confine themselves to each sequence;
* padded: one right-padded row per sequence with an attention mask; each sequence's real tokens come first,
  so causal attention never lets them see the padding.

Either way each sequence occupies a span of the flattened [rows x width] tokens of the pass, where the capture
hooks write its states.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

from dflash_queue.engines.packing import cu_seqlens, packed_position_ids, plan_packs, plan_padded_batches


@dataclass(frozen=True)
class PassInputs:
    tensors: dict[str, torch.Tensor]  # model inputs, on the CPU
    spans: list[tuple[int, int]]  # each sequence's rows in the flattened tokens of the pass
    bounds: list[int] | None = None  # packed: the sequences' offsets in the row


def plan_passes(mode: str, lengths: Sequence[int], token_budget: int) -> list[list[int]]:
    return plan_packs(lengths, token_budget) if mode == "packed" else plan_padded_batches(lengths, token_budget)


def packed_inputs(sequences: Sequence[Sequence[int]]) -> PassInputs:
    lengths = [len(s) for s in sequences]
    bounds = cu_seqlens(lengths)
    return PassInputs(
        {
            "input_ids": torch.tensor([t for s in sequences for t in s])[None],
            "position_ids": packed_position_ids(lengths),
        },
        list(zip(bounds[:-1], bounds[1:])),
        bounds,
    )


def padded_inputs(sequences: Sequence[Sequence[int]]) -> PassInputs:
    width = max(len(s) for s in sequences)
    ids = torch.zeros((len(sequences), width), dtype=torch.long)
    mask = torch.zeros((len(sequences), width), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        mask[row, : len(sequence)] = 1
    spans = [(row * width, row * width + len(s)) for row, s in enumerate(sequences)]
    return PassInputs({"input_ids": ids, "attention_mask": mask}, spans)


# Token statistics are reduced a chunk of tokens at a time, each chunk converted once into a float32 buffer that
# stays in the core's cache while the three reductions read it: one pass over the states' bytes in memory, and no
# float32 copy of a whole pass. On the host this runs in numpy, each thread on a range of tokens of its own:
# hundreds of small torch ops would each open an OpenMP parallel region, and on a busy machine every region waits
# for all its threads to be scheduled (measured on 2 shared cores: 20-50x slower than one thread). On a GPU, torch,
# with larger chunks.
HOST_CHUNK_BYTES = 1 << 20
DEVICE_CHUNK_BYTES = 64 << 20
# Below this many tokens per thread, the calling thread does it alone.
HOST_MIN_TOKENS_PER_THREAD = 64
_HOST_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_host_pool: ThreadPoolExecutor | None = None
_host_pool_lock = threading.Lock()


def token_stats(buffer: torch.Tensor) -> torch.Tensor:
    """[rows, K, 3] float32, on the buffer's device: per token and captured layer of `buffer` [rows, K, H], the
    largest value, the smallest (exact: bfloat16 and float16 values convert to float32 exactly) and the RMS
    (accumulated in float32).

    A NaN anywhere in a token's layer makes its largest and smallest value NaN (numpy's max and min and torch's
    amax and amin propagate NaN), an infinity shows as one of them: the values are all finite exactly when both
    are (`all_finite`)."""
    if buffer.device.type == "cpu" and buffer.dtype in _HOST_DTYPES:
        return _host_token_stats(buffer)
    return _device_token_stats(buffer)


def _host_token_stats(buffer: torch.Tensor) -> torch.Tensor:
    rows, layers, width = buffer.shape
    stats = torch.empty((rows, layers, 3), dtype=torch.float32)
    # A bfloat16 is the top half of the float32 of the same value: its bits shifted into a uint32 are that float.
    source = buffer.view(torch.int16).numpy().view(np.uint16) if buffer.dtype == torch.bfloat16 else buffer.numpy()
    out = stats.numpy()
    threads = max(1, min(torch.get_num_threads(), rows // HOST_MIN_TOKENS_PER_THREAD))
    if threads == 1:
        _host_stats_of_range(source, out, 0, rows)
    else:
        step = -(-rows // threads)
        ranges = [(start, min(start + step, rows)) for start in range(0, rows, step)]
        for done in [_pool(threads).submit(_host_stats_of_range, source, out, a, b) for a, b in ranges]:
            done.result()
    stats[..., 2] /= width**0.5
    return stats


def _host_stats_of_range(source: np.ndarray, out: np.ndarray, begin: int, end: int) -> None:
    """Largest, smallest value and root of the sum of squares of tokens [begin, end) of `source` (bfloat16 bits
    as uint16, or float16 / float32 values) into `out`."""
    _, layers, width = source.shape
    chunk = max(1, HOST_CHUNK_BYTES // max(1, layers * width * 4))
    bits = source.dtype == np.uint16
    scratch = None if source.dtype == np.float32 else np.empty((chunk, layers, width), np.uint32 if bits else np.float32)
    with np.errstate(all="ignore"):  # NaN and overflow are results here, not warnings
        for start in range(begin, end, chunk):
            stop = min(start + chunk, end)
            if scratch is None:
                values = source[start:stop]
            elif bits:
                widened = scratch[: stop - start]
                widened[...] = source[start:stop]
                values = np.left_shift(widened, 16, out=widened).view(np.float32)
            else:
                values = scratch[: stop - start]
                values[...] = source[start:stop]
            np.max(values, axis=2, out=out[start:stop, :, 0])
            np.min(values, axis=2, out=out[start:stop, :, 1])
            np.sqrt(np.einsum("tkh,tkh->tk", values, values), out=out[start:stop, :, 2])


def _pool(threads: int) -> ThreadPoolExecutor:
    global _host_pool
    with _host_pool_lock:
        if _host_pool is None or _host_pool._max_workers < threads:
            _host_pool = ThreadPoolExecutor(threads, thread_name_prefix="dfq-token-stats")
        return _host_pool


def _device_token_stats(buffer: torch.Tensor) -> torch.Tensor:
    rows, layers, width = buffer.shape
    stats = torch.empty((rows, layers, 3), dtype=torch.float32, device=buffer.device)
    chunk = max(1, min(rows, DEVICE_CHUNK_BYTES // max(1, layers * width * 4)))
    scratch = torch.empty((chunk, layers, width), dtype=torch.float32, device=buffer.device)
    for start in range(0, rows, chunk):
        stop = min(start + chunk, rows)
        values = scratch[: stop - start]
        values.copy_(buffer[start:stop])
        torch.amax(values, dim=2, out=stats[start:stop, :, 0])
        torch.amin(values, dim=2, out=stats[start:stop, :, 1])
        torch.linalg.vector_norm(values, dim=2, out=stats[start:stop, :, 2])
    stats[..., 2] /= width**0.5
    return stats


def finite_tokens(stats: torch.Tensor) -> torch.Tensor:
    """[rows] bool from `token_stats`: every value of the token, at every layer, is finite."""
    return (torch.isfinite(stats[..., 0]) & torch.isfinite(stats[..., 1])).all(dim=-1)


def all_finite(stats: torch.Tensor) -> bool:
    """Every value the statistics (per token [rows, K, 3], or a summary [K, 3]) were taken over is finite."""
    return bool(torch.isfinite(stats[..., :2]).all())


def summarize(stats: torch.Tensor) -> torch.Tensor:
    """One sequence's [T, K, 3] token statistics -> [K, 3]: largest value, smallest, median token RMS."""
    return torch.stack([stats[..., 0].amax(0), stats[..., 1].amin(0), stats[..., 2].median(0).values], dim=1)
