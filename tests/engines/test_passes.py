"""The per-token statistics every extract engine checks its states with (engines/passes.py): exact against float64
arithmetic in each dtype the engines run (bfloat16 first), across chunk and thread boundaries, on the host path
(numpy) and the device path (torch, run here on the CPU); and every fault the checks must see shows in them: NaN and
infinities of either sign, zero and constant rows."""

from __future__ import annotations

import pytest
import torch

from dflash_queue.engines import passes
from dflash_queue.engines.passes import all_finite, finite_tokens, summarize, token_stats

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
PATHS = {"host": passes._host_token_stats, "device": passes._device_token_stats}


def sample(rows: int = 37, layers: int = 3, width: int = 96, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(rows * 31 + width)
    scale = torch.logspace(-2, 2, rows).view(-1, 1, 1)  # tokens of very different sizes
    return (torch.randn(rows, layers, width, generator=generator, dtype=torch.float64) * scale).to(dtype)


def reference(states: torch.Tensor) -> torch.Tensor:
    """Largest, smallest and RMS per token and layer, in float64, one row at a time."""
    out = torch.empty((*states.shape[:2], 3), dtype=torch.float64)
    for t in range(states.shape[0]):
        for k in range(states.shape[1]):
            row = [float(v) for v in states[t, k].double()]
            out[t, k, 0] = max(row)
            out[t, k, 1] = min(row)
            out[t, k, 2] = (sum(v * v for v in row) / len(row)) ** 0.5
    return out


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of a few tokens and two threads of a dozen tokens each, so that both boundaries are crossed."""
    monkeypatch.setattr(passes, "HOST_CHUNK_BYTES", 3 * 3 * 96 * 4)
    monkeypatch.setattr(passes, "DEVICE_CHUNK_BYTES", 5 * 3 * 96 * 4)
    monkeypatch.setattr(passes, "HOST_MIN_TOKENS_PER_THREAD", 12)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 3)


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_largest_and_smallest_are_exact_and_the_rms_is_float32_close(small_chunks, path, dtype):
    states = sample(dtype=dtype)
    got = PATHS[path](states)
    expected = reference(states)
    assert got.dtype == torch.float32 and got.shape == (37, 3, 3)
    assert torch.equal(got[..., :2].double(), expected[..., :2])  # the states' own values, converted exactly
    torch.testing.assert_close(got[..., 2].double(), expected[..., 2], rtol=2e-6, atol=0)


def test_token_stats_takes_the_host_path_on_the_cpu_and_both_paths_agree(small_chunks, monkeypatch):
    states = sample(rows=50)
    taken = []
    monkeypatch.setattr(passes, "_host_token_stats", lambda b: taken.append("host") or PATHS["host"](b))
    host = token_stats(states)
    assert taken == ["host"]
    device = PATHS["device"](states)
    assert torch.equal(host[..., :2], device[..., :2])
    torch.testing.assert_close(host[..., 2], device[..., 2], rtol=2e-6, atol=0)
    assert token_stats(states.double()).dtype == torch.float32  # other dtypes: the device path


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(
    "value, poisoned",
    [(float("nan"), (0, 1)), (-float("nan"), (0, 1)), (float("inf"), (0,)), (-float("inf"), (1,))],
    ids=["nan", "negative-nan", "inf", "-inf"],
)
def test_a_single_nan_or_infinity_shows_in_its_token_and_layer(small_chunks, path, dtype, value, poisoned):
    for position in [(0, 0, 0), (11, 1, 47), (36, 2, 95)]:  # first, middle, last element of the sample
        states = sample(dtype=dtype)
        states[position] = value
        stats = PATHS[path](states)
        t, k, _ = position
        for column in (0, 1):
            shown = stats[t, k, column]
            assert (not torch.isfinite(shown)) == (column in poisoned), (position, column, shown)
            if column in poisoned and value == value:  # an infinity keeps its sign
                assert float(shown) == value
        others = torch.ones(stats.shape[:2], dtype=torch.bool)
        others[t, k] = False
        assert torch.isfinite(stats[..., :2][others]).all()
        assert finite_tokens(stats).tolist() == [row != t for row in range(37)]
        assert not all_finite(stats) and not all_finite(summarize(stats))
        assert all_finite(torch.cat([stats[:t], stats[t + 1 :]]))


@pytest.mark.parametrize("path", sorted(PATHS))
def test_zero_and_constant_rows_show_as_equal_largest_and_smallest_values(small_chunks, path):
    states = sample()
    states[4, 1] = 0.0
    states[5, 2] = -0.0
    states[6, 0] = 0.5
    states[7, 1, ::2] = -0.0  # zeros of both signs
    states[7, 1, 1::2] = 0.0
    stats = PATHS[path](states)
    for t, k in [(4, 1), (5, 2), (7, 1)]:
        assert stats[t, k].tolist() == [0.0, 0.0, 0.0]
    assert stats[6, 0].tolist() == [0.5, 0.5, 0.5]
    equal = stats[..., 0] == stats[..., 1]
    assert equal.nonzero().tolist() == [[4, 1], [5, 2], [6, 0], [7, 1]]
    assert all_finite(stats)


@pytest.mark.parametrize("path", sorted(PATHS))
def test_the_largest_finite_values_are_finite_and_their_rms_is_not(path):
    """bfloat16's largest values square past float32's range: the RMS overflows (an outlier the plausibility check
    rejects), the values themselves are finite and the finiteness check says so."""
    states = sample(rows=4, dtype=torch.bfloat16)
    states[2, 1] = torch.finfo(torch.bfloat16).max
    stats = PATHS[path](states)
    assert float(stats[2, 1, 0]) == float(torch.finfo(torch.bfloat16).max)
    assert stats[2, 1, 2] == float("inf")
    assert all_finite(stats)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_the_summary_of_a_sample_keeps_a_non_finite_value_of_any_token(value):
    """The shard writer trusts a summary's largest and smallest values: a NaN or an infinity in one token of many
    must reach them, whatever the median RMS does (it keeps a NaN, not an infinity)."""
    states = sample(rows=9)
    states[3, 2, 5] = value
    summary = summarize(token_stats(states))
    assert summary.shape == (3, 3)
    assert not torch.isfinite(summary[2, :2]).all() and torch.isfinite(summary[:2]).all()
    assert not all_finite(summary)
    if value != value:
        assert torch.isnan(summary[2]).all()
    else:
        assert torch.isfinite(summary[2, 2])  # the median RMS alone would not show it


def test_an_empty_pass_has_empty_statistics():
    assert token_stats(sample(rows=1)[:0]).shape == (0, 3, 3)
