"""The vLLM connector's hand-over of finished sequences' states, on tensor-parallel rank 0: rows out of the
hidden-state cache, their statistics, the copy to the host and the states file. Plain torch: no vLLM import, so
the connector (engines/vllm/states_connector.py, which runs it in vLLM's model worker) and the host-path benchmark
(tools/bench_host_path.py, where vLLM may be absent) run this same code.

A sequence's rows are gathered from the cache ([blocks, K, block_size, H], on its device), their per-token
statistics reduced there (engines/passes.py), and states, token ids and statistics written as one states file
(engines/vllm/states_file.py) under a temporary name, then renamed into place. On CUDA, states and statistics are
first copied on a side stream into pinned host memory and the file is written by a thread; the request is done
(its blocks may be freed) once the copy is. On the CPU all of it happens in the call. A failure is reported to
`report_error(path, message, io_error=...)` (the connector leaves the reason beside the file's name).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

import torch

from dflash_queue.engines.passes import token_stats
from dflash_queue.engines.vllm.states_file import save_states

PARTIAL_SUFFIX = ".partial"  # a file being written; renamed into place when whole


@dataclass
class StatesTransfer:
    """A finished sequence whose states go to the worker."""

    request_id: str
    path: str
    block_ids: list[int]
    token_ids: list[int]
    sample: str = ""
    canary: bool = False


class ErrorReport(Protocol):
    def __call__(self, path: str, message: str, *, io_error: bool = False) -> None: ...


class StatesSender:
    """Hands finished sequences' states from `cache` [blocks, K, block_size, H] to their states files."""

    def __init__(self, cache: torch.Tensor, block_size: int, report_error: ErrorReport) -> None:
        self.cache = cache
        self.block_size = block_size
        self._report_error = report_error
        self._copies: dict[str, torch.cuda.Event | None] = {}  # request id -> its device-to-host copy (None: done)
        self.files_written = 0
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="dfq-states") if cache.is_cuda else None
        self._stream: torch.cuda.Stream | None = None

    def gather(self, transfer: StatesTransfer) -> torch.Tensor:
        """The sequence's rows of the cache: [tokens, K, H] (on the cache's device)."""
        blocks = torch.tensor(transfer.block_ids, dtype=torch.long)
        offsets = torch.arange(self.block_size, dtype=torch.long)
        slots = (blocks[:, None] * self.block_size + offsets[None, :]).flatten()[: len(transfer.token_ids)]
        if len(slots) < len(transfer.token_ids):
            raise ValueError(
                f"request {transfer.request_id}: {len(transfer.block_ids)} blocks hold {len(slots)} states for "
                f"{len(transfer.token_ids)} tokens"
            )
        slots = slots.to(self.cache.device, non_blocking=True)
        return self.cache[slots // self.block_size, :, slots % self.block_size]

    def send(
        self,
        transfer: StatesTransfer,
        rows: Callable[[StatesTransfer], torch.Tensor | None] | None = None,
        write_fault: Callable[[StatesTransfer], int] | None = None,
    ) -> Future[None] | None:
        """The transfer's states to its file. `rows`: what gathers them (default `gather`; None back: `rows` kept a
        copy of them to send later, so nothing is written now and the blocks are released); `write_fault`: the errno
        its write fails with (test fault; 0: none). On CUDA, the pending write."""
        try:
            states = (rows or self.gather)(transfer)
            # Where the states are, before any copy: the worker checks the sequence from these.
            stats = None if states is None else token_stats(states)
        except Exception as exc:  # the worker must learn why its states never came
            self._report_error(transfer.path, f"gathering the states failed: {type(exc).__name__}: {exc}")
            self._copies[transfer.request_id] = None
            return None
        if states is None or stats is None:  # held back (a swap fault) until its partner finishes
            self._copies[transfer.request_id] = None
            return None
        tokens = torch.tensor(transfer.token_ids, dtype=torch.int64)
        fail_with = write_fault(transfer) if write_fault is not None else 0
        if self.cache.is_cuda:
            return self._copy_and_write_async(transfer, states, stats, tokens, fail_with)
        # The gathered rows are a tensor of their own already (an indexed copy of the cache): written as they are.
        self.write(transfer.path, states, tokens, stats, fail_with=fail_with)
        self._copies[transfer.request_id] = None
        return None

    def _copy_and_write_async(
        self, transfer: StatesTransfer, states: torch.Tensor, stats: torch.Tensor, tokens: torch.Tensor, fail_with: int
    ) -> Future[None]:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        computed = torch.cuda.Event()
        computed.record()  # the forward passes that wrote the cache and the statistics, on the current stream
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(computed)
            host = torch.empty(states.shape, dtype=states.dtype, pin_memory=True)
            host.copy_(states, non_blocking=True)
            host_stats = torch.empty(stats.shape, dtype=stats.dtype, pin_memory=True)
            host_stats.copy_(stats, non_blocking=True)
            states.record_stream(self._stream)
            stats.record_stream(self._stream)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        self._copies[transfer.request_id] = copied
        assert self._pool is not None

        def write() -> None:
            copied.synchronize()
            self.write(transfer.path, host, tokens, host_stats, fail_with=fail_with)

        return self._pool.submit(write)

    def write(
        self, path: str, states: torch.Tensor, tokens: torch.Tensor, stats: torch.Tensor, *, fail_with: int = 0
    ) -> None:
        """The file appears whole or not at all; a failure is reported, io_error when the file system refused it
        (full, failing). `fail_with`: an errno to fail with (test fault)."""
        partial = f"{path}{PARTIAL_SUFFIX}"
        try:
            if fail_with:
                raise OSError(fail_with, os.strerror(fail_with), partial)
            save_states(partial, states, tokens, stats)
            os.replace(partial, path)
            self.files_written += 1
        except Exception as exc:
            self._report_error(path, f"writing {path} failed: {type(exc).__name__}: {exc}", io_error=is_io_error(exc))
            try:
                os.unlink(partial)
            except OSError:
                pass

    def done(self) -> set[str]:
        """The requests whose states have left the cache since the last call (their blocks may be freed)."""
        done = set()
        for request_id, event in list(self._copies.items()):
            if event is None or event.query():
                del self._copies[request_id]
                done.add(request_id)
        return done

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def is_io_error(exc: Exception) -> bool:
    """An error of the file system (ENOSPC, EIO, ...): an OSError, or safetensors' error wrapping one."""
    return isinstance(exc, OSError) or (type(exc).__name__ == "SafetensorError" and "I/O error" in str(exc))
