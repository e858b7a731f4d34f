"""The file one finished sequence's states cross from vLLM's processes to the extract worker in, and the worker's
checks of it. Plain torch and safetensors: no vLLM import, so the host path can be measured where vLLM is absent.

The connector (engines/vllm/states_connector.py) writes, as one safetensors file in the transfer directory (a
tmpfs), the sequence's states [T, aux, H], the token ids the engine prefilled [T], and the per-token statistics
of those states [T, aux, 3] (largest value, smallest, RMS: engines/passes.py), computed where the states are, on
the cache's device before the copy to the host. The worker reads the file without copying it (a memory map of the
tmpfs pages, the file unlinked at once: its memory goes with the last view of it) and checks the
sequence from the token ids and the statistics alone; the states' bytes are next read by the shard writer, which
copies them into the shard file once.

Checked on every sequence (`receive_states`), each failure an EngineStatesInvalid naming the sample: the token ids
are the request's; states and statistics have one row per token at every aux layer; no row is all zero (largest
and smallest value both 0: a zeroed cache row the engine never wrote). Non-finite values are left to the caller,
which names those samples (NonFiniteHiddenStates) and hands the others over.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from dflash_queue.errors import EngineStatesInvalid, ShardFormatError
from dflash_queue.shards.layout import header_length, parse_header

STATES_TENSOR = "hidden_states"
TOKENS_TENSOR = "token_ids"
STATS_TENSOR = "token_stats"


def save_states(path: str, states: torch.Tensor, tokens: torch.Tensor, stats: torch.Tensor) -> None:
    """One sequence's states [T, aux, H], token ids [T] and statistics [T, aux, 3] (all on the host)."""
    save_file({STATES_TENSOR: states.contiguous(), TOKENS_TENSOR: tokens, STATS_TENSOR: stats.contiguous()}, path)


def load_states(path: str | Path) -> dict[str, torch.Tensor]:
    """The tensors of a states file, viewing a memory map of it (no copy). The file is unlinked once mapped: its
    pages are this process's alone, writable, and released with the last tensor that views them."""
    where = str(path)
    try:
        try:
            fd, flags = os.open(path, os.O_RDWR | os.O_CLOEXEC), mmap.MAP_SHARED
        except PermissionError:  # a file of another user: a private copy-on-write map, ~2x slower to set up
            fd, flags = os.open(path, os.O_RDONLY | os.O_CLOEXEC), mmap.MAP_PRIVATE
    except FileNotFoundError:
        raise EngineStatesInvalid(f"{where}: the states file is gone") from None
    try:
        size = os.fstat(fd).st_size
        if size < 8:
            raise EngineStatesInvalid(f"{where}: {size} bytes is no states file")
        # Populated at once: the shard writer's copy then reads mapped pages without faulting on each.
        mapped = mmap.mmap(fd, size, flags=flags | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
        Path(path).unlink(missing_ok=True)
    buffer = torch.frombuffer(mapped, dtype=torch.uint8)
    try:
        length = header_length(bytes(buffer[:8].numpy()), where=where)
        layout = parse_header(bytes(buffer[8 : 8 + length].numpy()), where=where, file_size=size)
    except ShardFormatError as exc:
        raise EngineStatesInvalid(str(exc)) from None
    return {
        name: buffer[spec.begin : spec.end].view(spec.torch_dtype).reshape(spec.shape)
        for name, spec in layout.tensors.items()
    }


@dataclass(frozen=True)
class ReceivedStates:
    states: torch.Tensor  # [T, K, H]: the captured entries in the config's order
    stats: torch.Tensor  # [T, K, 3] float32: largest value, smallest, RMS per token and entry


def receive_states(
    path: str | Path,
    sample_id: str,
    input_ids: Sequence[int],
    aux_ids: Sequence[int],
    columns: torch.Tensor,
    hidden_size: int,
) -> ReceivedStates:
    """The states the connector wrote for one sequence, checked (see the module docstring), with the entries put in
    the config's order (`columns`: the aux column of each entry; no copy when that is the order they came in)."""
    tensors = load_states(path)
    missing = [name for name in (STATES_TENSOR, TOKENS_TENSOR, STATS_TENSOR) if name not in tensors]
    if missing:
        raise EngineStatesInvalid(f"sample {sample_id}: the states file {path} lacks {', '.join(missing)}")
    states, tokens, stats = tensors[STATES_TENSOR], tensors[TOKENS_TENSOR], tensors[STATS_TENSOR]
    expected = torch.tensor(list(input_ids), dtype=tokens.dtype)
    if tokens.shape != expected.shape or not torch.equal(tokens, expected):
        raise EngineStatesInvalid(
            f"sample {sample_id}: the vLLM engine returned the states of {tokens.numel()} other tokens for this "
            f"sequence of {expected.numel()}"
        )
    shape = (expected.numel(), len(aux_ids), hidden_size)
    if tuple(states.shape) != shape:
        raise EngineStatesInvalid(
            f"sample {sample_id}: the vLLM engine returned states of shape {tuple(states.shape)}, expected {shape} "
            "(tokens, aux layers, hidden)"
        )
    if tuple(stats.shape) != (*shape[:2], 3) or stats.dtype != torch.float32:
        raise EngineStatesInvalid(
            f"sample {sample_id}: the vLLM engine's token statistics have shape {tuple(stats.shape)} and dtype "
            f"{stats.dtype}, expected {(*shape[:2], 3)} float32"
        )
    unwritten = (stats[..., 0] == 0) & (stats[..., 1] == 0)  # [T, aux]: a zeroed cache row the engine never wrote
    if unwritten.any():
        tokens_hit = unwritten.any(dim=1).nonzero().flatten()
        layer = aux_ids[int(unwritten.any(dim=0).nonzero()[0])]
        raise EngineStatesInvalid(
            f"sample {sample_id}: the vLLM engine never wrote the states of {tokens_hit.numel()} of "
            f"{expected.numel()} tokens (first token {int(tokens_hit[0])}, aux layer {layer}): all zero"
        )
    if not torch.equal(columns, torch.arange(len(aux_ids))):
        states, stats = states.index_select(1, columns), stats.index_select(1, columns)
    return ReceivedStates(states, stats)
