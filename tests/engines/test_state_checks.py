from __future__ import annotations

import pytest
import torch

from dflash_queue.engines.state_checks import (
    CALIBRATION_FACTOR,
    HEAD_TOKENS,
    TOLERANCE_FLOORS,
    CanaryMismatch,
    CanaryTolerance,
    ImplausibleHiddenStates,
    calibrate,
    check_canary,
    check_plausible,
    compare_states,
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
    tight = CanaryTolerance.fixed(1e-4)
    assert check_canary("s1", reference.clone(), reference, LAYERS, tight).worst == 0.0
    shifted = reference.clone()
    shifted[:, 1] += 0.1 * reference[:, 1]
    with pytest.raises(CanaryMismatch, match=r"canary sample s1: layer 3 \(decoder_output\) .* 1\.000e-01"):
        check_canary("s1", shifted, reference, LAYERS, tight)
    assert check_canary("s1", shifted, reference, LAYERS, CanaryTolerance.fixed(0.2)).worst == pytest.approx(0.1)


def test_a_faint_leak_into_the_first_tokens_of_a_long_sample_fails_on_its_head():
    """1e-3 of another sequence's state in the first 8 of 2,000 tokens is ~7e-5 of the whole sample: under a
    whole-sample bound, over the head's."""
    reference = states(2, tokens=2000)
    leaked = reference.clone()
    carried = states(3, tokens=1)[0]
    for t in range(HEAD_TOKENS):
        leaked[t] += 1e-3 * reference[t].norm(dim=-1, keepdim=True) * carried / carried.norm(dim=-1, keepdim=True)
    difference = compare_states(leaked, reference)
    assert difference.worst < 1e-4 and difference.worst_head == pytest.approx(1e-3, rel=0.05)
    tolerance = CanaryTolerance(whole=2e-4, head=2e-4)
    with pytest.raises(CanaryMismatch, match=r"layer \d \(decoder_output\), first 8 tokens, differs .* 1\.0\d\de-03 "
                                             r"\(whole sample [\d.]+e-05; tolerance 2\.0e-04\): something runs on across "
                                             r"the pack boundary"):
        check_canary("s2", leaked, reference, LAYERS, tolerance)


def test_the_tolerance_is_a_multiple_of_the_calibrated_noise_never_below_the_dtypes_floor():
    reference = states(4)
    noisy = reference.clone()
    noisy[3] *= 1 + 1e-3  # a token off by a rounding, outside the head
    noisy[0] *= 1 + 2e-3  # and one inside it
    difference = compare_states(noisy, reference)
    tolerance = calibrate(torch.bfloat16, [difference, compare_states(reference, reference)])
    assert tolerance.noise_whole == difference.worst and tolerance.noise_head == difference.worst_head
    assert tolerance.whole == pytest.approx(CALIBRATION_FACTOR * difference.worst)
    assert tolerance.head == pytest.approx(CALIBRATION_FACTOR * difference.worst_head)
    exact = calibrate(torch.bfloat16, [compare_states(reference, reference)])
    assert (exact.whole, exact.head) == TOLERANCE_FLOORS[torch.bfloat16]  # bit-identical passes: the floor
    floors = [TOLERANCE_FLOORS[dtype][0] for dtype in (torch.float32, torch.float16, torch.bfloat16)]
    assert floors == sorted(floors)


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


def test_a_calibration_that_measures_more_than_rounding_gives_no_tolerance():
    """A pass that computes something else for a sequence with nothing before it (a window ignored everywhere)
    would calibrate a tolerance that hides itself: beyond the dtype's noise ceiling the mode is not exact."""
    assert not CanaryTolerance.calibrated(torch.bfloat16, 1e-3, 0.0).beyond_rounding(torch.bfloat16)
    assert CanaryTolerance.calibrated(torch.bfloat16, 0.3, 0.0).beyond_rounding(torch.bfloat16)
    assert CanaryTolerance.calibrated(torch.float32, 2e-3, 0.0).beyond_rounding(torch.float32)
    assert not CanaryTolerance.calibrated(torch.float32, 1e-6, 0.0).beyond_rounding(torch.float32)
