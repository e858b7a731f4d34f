from __future__ import annotations

import pytest
import torch

from dflash_queue.engines.state_checks import (
    CanaryMismatch,
    ImplausibleHiddenStates,
    check_canary,
    check_plausible,
    compare_states,
    default_tolerance,
)

LAYERS = ["1 (decoder_output)", "3 (decoder_output)"]


def states(seed: int, tokens: int = 12) -> torch.Tensor:
    return torch.randn(tokens, 2, 8, generator=torch.Generator().manual_seed(seed)) * 3


def test_errors_are_relative_per_layer_and_per_token():
    reference = states(0)
    got = reference.clone()
    got[0, 1] *= 1.5  # the first token of layer 3 off by half its norm (a leak confined to a sequence's start)
    difference = compare_states(got, reference)
    assert difference.relative[0] == 0.0 and difference.worst_token[0] == 0.0
    assert difference.worst_token[1] == pytest.approx(0.5)
    whole = 0.5 * reference[0, 1].norm() / reference[:, 1].norm()
    assert difference.relative[1] == pytest.approx(float(whole))
    with pytest.raises(ValueError, match="compared with"):
        compare_states(got[:5], reference)


def test_the_canary_names_the_sample_the_layer_and_the_error():
    reference = states(1)
    assert check_canary("s1", reference.clone(), reference, LAYERS, 1e-4).worst == 0.0
    shifted = reference.clone()
    shifted[:, 1] += 0.1 * reference[:, 1]
    with pytest.raises(CanaryMismatch, match=r"canary sample s1: layer 3 \(decoder_output\) .* 1\.000e-01"):
        check_canary("s1", shifted, reference, LAYERS, 1e-4)
    assert check_canary("s1", shifted, reference, LAYERS, 0.2).worst == pytest.approx(0.1)


def test_tolerances_follow_the_dtype():
    assert default_tolerance(torch.float32) < default_tolerance(torch.float16) < default_tolerance(torch.bfloat16)


def summary(high: float, low: float, rms: float) -> torch.Tensor:
    return torch.tensor([[high, low, rms], [2.0, -2.0, 1.0]])


def test_plausible_states_pass():
    check_plausible(list("abcde"), [summary(3, -3, 1 + i / 10) for i in range(5)], LAYERS, 50.0)


@pytest.mark.parametrize(
    ("bad", "message"),
    [
        (summary(0, 0, 0), r"sample c, layer 1 \(decoder_output\): all zero"),
        (summary(0.5, 0.5, 0.5), r"sample c, layer 1 \(decoder_output\): constant \(0\.5\)"),
        (summary(900, -900, 300), r"sample c, layer 1 \(decoder_output\): median token RMS 300 is 300 x the shard's"),
        (summary(1e-3, -1e-3, 1e-3), r"sample c, layer 1 .* is 0\.001 x the shard's median"),
    ],
)
def test_states_no_forward_pass_gives_fail_the_shard(bad, message):
    summaries = [summary(3, -3, 1.0) for _ in range(5)]
    summaries[2] = bad
    with pytest.raises(ImplausibleHiddenStates, match=message):
        check_plausible(list("abcde"), summaries, LAYERS, 50.0)


def test_the_rms_check_needs_a_few_samples_to_compare_with():
    check_plausible(list("ab"), [summary(3, -3, 1.0), summary(900, -900, 300)], LAYERS, 50.0)
