"""The connector's hand-over (engines/vllm/states_sender.py), without vLLM, on the CPU: a sequence's rows read from
scattered blocks of the hidden-state cache, written with their statistics as a states file the worker's own
`receive_states` accepts; each failure reported against the file's path, nothing half-written left behind."""

from __future__ import annotations

import errno

import torch

from dflash_queue.engines.passes import token_stats
from dflash_queue.engines.vllm.states_file import receive_states
from dflash_queue.engines.vllm.states_sender import StatesSender, StatesTransfer

BLOCK = 4
K, H = 3, 8


class Reports:
    def __init__(self) -> None:
        self.seen: list[tuple[str, str, bool]] = []

    def __call__(self, path: str, message: str, *, io_error: bool = False) -> None:
        self.seen.append((path, message, io_error))


def cache_holding(rows: torch.Tensor, block_ids: list[int], blocks: int) -> torch.Tensor:
    """A cache [blocks, K, BLOCK, H] of noise whose `block_ids` hold `rows` [T, K, H] in order."""
    cache = torch.randn(blocks, K, BLOCK, H, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    for number, block in enumerate(block_ids):
        part = rows[number * BLOCK : (number + 1) * BLOCK]
        cache[block, :, : len(part)] = part.transpose(0, 1)
    return cache


def test_the_rows_of_scattered_blocks_reach_the_worker_as_they_were(tmp_path):
    rows = torch.randn(10, K, H, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    block_ids = [5, 1, 3]  # 12 slots for 10 tokens, in the order the scheduler gave them
    reports = Reports()
    sender = StatesSender(cache_holding(rows, block_ids, 6), BLOCK, reports)
    ids = list(range(100, 110))
    path = tmp_path / "c0.0.safetensors"
    transfer = StatesTransfer("r0", str(path), block_ids, ids)
    assert torch.equal(sender.gather(transfer), rows)
    assert sender.send(transfer) is None  # on the CPU, written in the call
    assert sender.done() == {"r0"} and sender.done() == set() and sender.files_written == 1
    received = receive_states(path, "s0", ids, [1, 2, 3], torch.arange(K), H)
    assert torch.equal(received.states, rows) and torch.equal(received.stats, token_stats(rows))
    assert reports.seen == [] and list(tmp_path.iterdir()) == []


def test_rows_kept_back_by_whoever_gathered_them_are_not_written_and_their_blocks_are_released(tmp_path):
    reports = Reports()
    sender = StatesSender(torch.zeros(2, K, BLOCK, H), BLOCK, reports)
    assert sender.send(StatesTransfer("r0", str(tmp_path / "c0.safetensors"), [0], [1, 2]), lambda t: None) is None
    assert sender.done() == {"r0"} and sender.files_written == 0 and reports.seen == []
    assert list(tmp_path.iterdir()) == []


def test_each_failure_is_reported_and_no_file_is_left(tmp_path):
    reports = Reports()
    sender = StatesSender(torch.ones(4, K, BLOCK, H), BLOCK, reports)
    short = StatesTransfer("r1", str(tmp_path / "c1.safetensors"), [2], list(range(6)))
    sender.send(short)
    assert reports.seen == [(short.path, "gathering the states failed: ValueError: request r1: 1 blocks hold 4 "
                                         "states for 6 tokens", False)]
    assert sender.done() == {"r1"}  # nothing waits on its blocks
    full = StatesTransfer("r2", str(tmp_path / "c2.safetensors"), [0, 1], list(range(6)))
    sender.send(full, write_fault=lambda t: errno.ENOSPC)
    path, message, io_error = reports.seen[1]
    assert path == full.path and io_error and message.startswith(f"writing {full.path} failed: OSError: [Errno 28]")
    missing = tmp_path / "gone" / "c3.safetensors"  # the directory went away: safetensors' own I/O error
    sender.send(StatesTransfer("r3", str(missing), [0, 1], list(range(6))))
    assert reports.seen[2][0] == str(missing) and reports.seen[2][2]
    assert sender.done() == {"r2", "r3"} and sender.files_written == 0 and list(tmp_path.iterdir()) == []
