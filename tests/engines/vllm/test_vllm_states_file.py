"""The states file between the vLLM connector and the extract worker (engines/vllm/states_file.py), without vLLM:
written as the connector writes it, read by the worker's own `receive_states`, in bfloat16. Every refusal names the
sample; the states come back as written (entries in the config's order), the file is gone once read, and the
checks read the statistics the connector sent, not the states."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from dflash_queue.engines.passes import all_finite, token_stats
from dflash_queue.engines.vllm.states_file import (
    STATES_TENSOR,
    STATS_TENSOR,
    TOKENS_TENSOR,
    receive_states,
    save_states,
)
from dflash_queue.errors import EngineStatesInvalid

AUX = [2, 4, 7]
IDS = [5, 17, 3, 99, 42, 8, 61, 7, 13, 21]


def states(tokens: int = len(IDS)) -> torch.Tensor:
    return torch.randn(tokens, len(AUX), 32, generator=torch.Generator().manual_seed(tokens)).to(torch.bfloat16)


def written(tmp_path: Path, values: torch.Tensor, ids=IDS, stats: torch.Tensor | None = None) -> Path:
    path = tmp_path / "c0.0.safetensors"
    save_states(str(path), values, torch.tensor(ids, dtype=torch.int64), token_stats(values) if stats is None else stats)
    return path


def receive(path: Path, columns=(0, 1, 2), ids=IDS):
    return receive_states(path, "s1", ids, AUX, torch.tensor(columns), 32)


def test_states_come_back_as_written_with_their_statistics_and_the_file_is_gone(tmp_path):
    values = states()
    path = written(tmp_path, values)
    received = receive(path)
    assert not path.exists()
    assert received.states.dtype == torch.bfloat16 and torch.equal(received.states, values)
    assert torch.equal(received.stats, token_stats(values))
    received.states[0, 0, 0] = 1.0  # the final-norm entry is replaced in place: the mapping is writable
    again = receive(written(tmp_path, values), columns=(2, 0, 1, 1))  # entries in the config's order
    assert torch.equal(again.states, values[:, [2, 0, 1, 1]])
    assert torch.equal(again.stats, token_stats(values)[:, [2, 0, 1, 1]])


def test_other_tokens_another_shape_or_no_file_are_refused_naming_the_sample(tmp_path):
    with pytest.raises(EngineStatesInvalid, match=r"sample s1: the vLLM engine returned the states of 10 other tokens "
                                                  r"for this sequence of 10"):
        receive(written(tmp_path, states(), ids=IDS[::-1]))
    with pytest.raises(EngineStatesInvalid, match=r"sample s1: .* of 9 other tokens for this sequence of 10"):
        receive(written(tmp_path, states(9), ids=IDS[:9]))
    wide = torch.zeros(len(IDS), len(AUX), 64, dtype=torch.bfloat16) + 1
    with pytest.raises(EngineStatesInvalid, match=r"sample s1: .* states of shape \(10, 3, 64\), expected \(10, 3, 32\)"):
        receive(written(tmp_path, wide))
    with pytest.raises(EngineStatesInvalid, match="the states file is gone"):
        receive(tmp_path / "never-written.safetensors")
    (tmp_path / "short.safetensors").write_bytes(b"12")
    with pytest.raises(EngineStatesInvalid, match="2 bytes is no states file"):
        receive(tmp_path / "short.safetensors")
    (tmp_path / "garbage.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"not json at all!")
    with pytest.raises(EngineStatesInvalid, match="not valid JSON"):
        receive(tmp_path / "garbage.safetensors")


def test_states_without_their_statistics_or_with_wrong_ones_are_refused(tmp_path):
    values = states()
    path = tmp_path / "old.safetensors"
    save_file({STATES_TENSOR: values, TOKENS_TENSOR: torch.tensor(IDS)}, str(path))
    with pytest.raises(EngineStatesInvalid, match=rf"sample s1: the states file {path} lacks {STATS_TENSOR}"):
        receive(path)
    with pytest.raises(EngineStatesInvalid, match=r"token statistics have shape \(10, 2, 3\) .* expected \(10, 3, 3\) float32"):
        receive(written(tmp_path, values, stats=token_stats(values)[:, :2]))
    with pytest.raises(EngineStatesInvalid, match=r"dtype torch.float64, expected \(10, 3, 3\) float32"):
        receive(written(tmp_path, values, stats=token_stats(values).double()))


@pytest.mark.parametrize("rows", [[4], [5, 6, 7, 8, 9]], ids=["one-token", "tail"])
def test_rows_the_engine_never_wrote_are_seen_in_the_statistics(tmp_path, rows):
    values = states()
    values[rows, 1] = 0  # the zeroed cache rows of one aux layer
    with pytest.raises(EngineStatesInvalid, match=rf"sample s1: the vLLM engine never wrote the states of {len(rows)} of "
                                                  rf"10 tokens \(first token {rows[0]}, aux layer 4\): all zero"):
        receive(written(tmp_path, values))
    values = states()
    values[rows, 1, :16] = 0  # half a row zero is a row the engine wrote
    assert torch.equal(receive(written(tmp_path, values)).states, values)


def test_the_checks_read_the_statistics_the_connector_sent_not_the_states(tmp_path):
    """Statistics computed where the states were are the only thing read: a zero row they do not show passes, and
    a zero row they show is refused though the states hold none."""
    values = states()
    hidden_zero = values.clone()
    hidden_zero[3] = 0
    assert receive(written(tmp_path, hidden_zero, stats=token_stats(values))).states[3].abs().sum() == 0
    claimed = token_stats(values)
    claimed[3, 0, :2] = 0
    with pytest.raises(EngineStatesInvalid, match="never wrote the states of 1 of 10 tokens"):
        receive(written(tmp_path, values, stats=claimed))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_non_finite_states_are_received_and_their_statistics_show_them(tmp_path, value):
    """Naming the samples with NaN or infinite states is the caller's (NonFiniteHiddenStates, after the others were
    handed over): receiving does not refuse them, and their statistics are not all finite."""
    values = states()
    values[6, 2, 30] = value
    received = receive(written(tmp_path, values))
    assert not all_finite(received.stats) and all_finite(received.stats[:6])


def test_a_file_of_another_user_is_read_through_a_private_map(tmp_path, monkeypatch):
    values = states()
    path = written(tmp_path, values)
    real_open = os.open

    def refuse_writing(file, flags, *args, **kwargs):
        if flags & os.O_RDWR:
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refuse_writing)
    received = receive(path)
    received.states[0] = 0  # still writable: copy on write
    assert torch.equal(received.states[1:], values[1:]) and not path.exists()
