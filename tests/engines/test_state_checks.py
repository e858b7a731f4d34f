from __future__ import annotations

import pytest
import torch

from dflash_queue.engines.state_checks import (
    CALIBRATION_FACTOR,
    HEAD_TOKENS,
    TOKEN_CALIBRATION_FACTOR,
    TOKEN_CEILINGS,
    TOKEN_FLOORS,
    TOLERANCE_CEILINGS,
    TOLERANCE_FLOORS,
    CanaryMismatch,
    CanaryTolerance,
    ImplausibleHiddenStates,
    TokenFocus,
    calibrate,
    check_canary,
    check_plausible,
    compare_states,
)
from dflash_queue.errors import ConfigError
from dflash_queue.lanes.config import CANARY_TOLERANCE_MAX

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
    tight = CanaryTolerance(1e-4, 1e-4, 1.0)
    assert check_canary("s1", reference.clone(), reference, LAYERS, tight).worst == 0.0
    shifted = reference.clone()
    shifted[:, 1] += 0.1 * reference[:, 1]
    with pytest.raises(CanaryMismatch, match=r"canary sample s1: layer 3 \(decoder_output\) .* 1\.000e-01"):
        check_canary("s1", shifted, reference, LAYERS, tight)
    assert check_canary("s1", shifted, reference, LAYERS, CanaryTolerance(0.2, 0.2, 1.0)).worst == pytest.approx(0.1)


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
    tolerance = CanaryTolerance(whole=2e-4, head=2e-4, token=0.1)
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


# ---------------------------------------------------------------------------------------------------------------
# The tokens that matter, per token


def test_the_tokens_that_matter_are_the_completion_and_every_token_past_the_shared_prefix():
    loss = [0] * 6 + [1] * 4
    assert TokenFocus.of(10, loss, shared_prefix=3).mask.tolist() == [False] * 3 + [True] * 7
    # A sequence another one starts with (an earlier turn of the same conversation): its completion still counts.
    assert TokenFocus.of(10, loss, shared_prefix=10).mask.tolist() == [False] * 6 + [True] * 4
    assert TokenFocus.of(4).tokens == 4 and TokenFocus.of(4, shared_prefix=4).tokens == 0
    with pytest.raises(ValueError, match="loss mask"):
        TokenFocus.of(5, loss)


def massive(seed: int, tokens: int, loud: int, factor: float = 150.0) -> torch.Tensor:
    """States whose first `loud` tokens carry massive activations (a trained model's: 100-170x the median token's
    RMS on SmolLM2-135M), the others ordinary."""
    found = states(seed, tokens)
    found[:loud] *= factor
    return found


def test_a_swap_past_a_long_shared_prefix_fails_on_its_worst_token_where_the_whole_sample_passes():
    """Two samples sharing a 300-token prefix (a system prompt) with massive activations in it, their 60 other tokens
    swapped: the whole sample moves by ~0.04, under the loosest whole-sample tolerance (the bfloat16 ceiling), while
    each swapped token is off by ~1.4, over the loosest per-token bound."""
    shared, own = 300, 60
    alone = massive(5, shared + own, loud=4)
    swapped = alone.clone()
    swapped[shared:] = states(6, own)  # the other request's states past the shared prefix
    focus = TokenFocus.of(shared + own, [0] * (shared + 20) + [1] * (own - 20), shared_prefix=shared)
    difference = compare_states(swapped, alone, focus)
    assert difference.worst < 0.1 and difference.worst_head == 0.0
    assert min(difference.focus_token) > 1.0 and min(difference.focus) > 1.0 and difference.focus_tokens == own
    assert shared <= min(difference.focus_token_at) and difference.shared_prefix == shared
    loosest = CanaryTolerance(TOLERANCE_CEILINGS[torch.bfloat16], TOLERANCE_CEILINGS[torch.bfloat16],
                              TOKEN_CEILINGS[torch.bfloat16])
    with pytest.raises(CanaryMismatch, match=r"canary sample s5: layer \d \(decoder_output\), token 3[0-5]\d, "
                                             r"differs from the sample run alone by relative error \d\.\d+e\+00 \(the "
                                             rf"worst of the {own} tokens that matter: its completion and the tokens "
                                             rf"past the {shared} it shares with another sample; relative error over "
                                             r"them 1\.\d+e\+00, over the whole sample [\d.]+e-02; per-token "
                                             r"tolerance 6\.0e-01\)"):
        check_canary("s5", swapped, alone, LAYERS, loosest, focus)
    # The whole-sample and first-token measures alone would pass it.
    assert check_canary("s5", swapped, alone, LAYERS, CanaryTolerance(0.25, 0.25, float("inf")), focus).worst < 0.1


def test_noise_outside_the_tokens_that_matter_is_not_gated_per_token():
    reference = states(7, 20)
    got = reference.clone()
    got[2] *= 1.5  # a token of the shared prefix, not in the loss
    focus = TokenFocus.of(20, [0] * 10 + [1] * 10, shared_prefix=10)
    difference = check_canary("s7", got, reference, LAYERS, CanaryTolerance(1.0, 1.0, 0.1), focus)
    assert difference.worst_focus_token == 0.0 and max(difference.worst_token) == pytest.approx(0.5)


def test_the_per_token_bound_is_a_multiple_of_the_worst_tokens_noise_between_floor_and_ceiling():
    reference = states(8)
    noisy = reference.clone()
    noisy[5] *= 1 + 0.05  # one token off by 5 %
    difference = compare_states(noisy, reference)  # no focus: every token counts, as in a calibration's probes
    assert difference.worst_focus_token == pytest.approx(0.05, rel=1e-4) == max(difference.worst_token)
    tolerance = calibrate(torch.bfloat16, [difference, compare_states(reference, reference)])
    assert tolerance.noise_token == difference.worst_focus_token
    assert tolerance.token == pytest.approx(TOKEN_CALIBRATION_FACTOR * 0.05)
    assert calibrate(torch.bfloat16, [compare_states(reference, reference)]).token == TOKEN_FLOORS[torch.bfloat16]
    assert CanaryTolerance.calibrated(torch.bfloat16, 0.0, 0.0, 0.5).token == TOKEN_CEILINGS[torch.bfloat16]
    assert CanaryTolerance.calibrated(torch.float32, 0.0, 0.0, 0.0).token == TOKEN_FLOORS[torch.float32]
    for dtype in TOKEN_CEILINGS:
        assert TOKEN_FLOORS[dtype] < TOKEN_CEILINGS[dtype]
    # Below what a swapped request gives its worst token on a trained model (1.24) and above the batching noise of
    # Qwen3-Next on vLLM's CPU build (0.27); a bit-identical calibration's bound above bfloat16's rounding of one
    # token (0.06 between two bfloat16 implementations, 0.10 against float32).
    assert 0.27 < TOKEN_CEILINGS[torch.bfloat16] < 1.24 / 2
    assert 0.10 < TOKEN_FLOORS[torch.bfloat16] * TOKEN_CALIBRATION_FACTOR
    assert tolerance.to_metadata()["token_tolerance"] == tolerance.token


def test_a_configured_tolerance_fixes_the_whole_sample_and_first_tokens_up_to_the_dtypes_ceiling():
    calibrated = CanaryTolerance.calibrated(torch.bfloat16, 1e-3, 2e-3, 0.04)
    fixed = calibrated.configured(0.2, torch.bfloat16)
    assert (fixed.whole, fixed.head, fixed.token) == (0.2, 0.2, calibrated.token)  # the per-token bound stays
    assert fixed.noise_whole == calibrated.noise_whole
    with pytest.raises(ConfigError, match=r"extract\.canary_tolerance = 0\.3 is above 0\.25, the canary's ceiling in "
                                          r"bfloat16"):
        calibrated.configured(0.3, torch.bfloat16)
    with pytest.raises(ConfigError, match=r"extract\.canary_tolerance = 0\.02 is above 0\.01, .* in float32"):
        CanaryTolerance.calibrated(torch.float32, 0.0, 0.0).configured(0.02, torch.float32)
    assert CANARY_TOLERANCE_MAX == max(TOLERANCE_CEILINGS.values())  # the config's bound, over every dtype
    assert CanaryTolerance.fixed(1e-3) == CanaryTolerance(1e-3, 1e-3, 1e-3)  # no calibration: one bound on all
