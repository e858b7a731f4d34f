"""The weights fingerprint's comparison: noise within the tolerance passes, another checkpoint does not, a near-tie
that noise tipped is not taken for other weights."""

from __future__ import annotations

import pytest

from dflash_queue.engines.server.fingerprint import ProbeToken, WeightsFingerprint, compare

PROMPT = (11, 12, 13)
RECORD = WeightsFingerprint(PROMPT, (ProbeToken(5, -0.2, -1.9), ProbeToken(6, -0.9, -1.0), ProbeToken(7, -0.1, -3.0)))


def answer(*tokens: tuple[int, float, float | None]) -> WeightsFingerprint:
    return WeightsFingerprint(PROMPT, tuple(ProbeToken(*t) for t in tokens), "http://b")


def test_the_same_tokens_with_logprobs_within_the_tolerance_are_the_same_weights():
    why, largest = compare(RECORD, answer((5, -0.23, -1.88), (6, -0.92, -0.97), (7, -0.1, -3.04)), 0.05)
    assert why == "" and largest == pytest.approx(0.04)


@pytest.mark.parametrize(
    ("found", "refusal"),
    [
        (((5, -0.2, -1.9), (6, -0.75, -1.0), (7, -0.1, -3.0)),
         "at greedy token 1 (6) its logprob is -0.7500, the record's -0.9000: 0.1500 apart"),
        (((5, -0.2, -1.6), (6, -0.9, -1.0), (7, -0.1, -3.0)),
         "at greedy token 0 (5) the runner-up's logprob is -1.6000, the record's -1.9000: 0.3000 apart"),
        (((5, -0.2, -1.9), (9, -0.3, -2.0), (7, -0.1, -3.0)),
         "at greedy token 1 it picks 9 (logprob -0.3000), the record 6 (logprob -0.9000)"),
        (((5, -0.2, -1.9), (6, -0.9, -1.0)), "its greedy reply has 2 tokens, the record's 3"),
    ],
)
def test_other_weights_are_told_apart_naming_the_token(found, refusal):
    why, _ = compare(RECORD, answer(*found), 0.05)
    assert refusal in why


def test_a_near_tie_that_noise_tipped_is_the_same_weights_and_what_follows_is_not_compared():
    # At token 1 the record's top two lie 0.1 apart: with a tolerance of 0.12 the other pick is noise.
    tipped = answer((5, -0.2, -1.9), (8, -0.93, -0.97), (1, -5.0, -6.0))
    assert compare(RECORD, tipped, 0.12)[0] == ""
    assert "it picks 8" in compare(RECORD, tipped, 0.05)[0]


def test_a_record_made_with_another_probe_is_not_compared_token_by_token():
    why, _ = compare(RECORD, WeightsFingerprint((1, 2), RECORD.tokens), 0.05)
    assert why.startswith("the probe's prompt differs from the one the record was made with")


def test_the_fingerprint_round_trips_through_its_json_and_bad_json_is_named():
    assert WeightsFingerprint.from_json(RECORD.to_json()) == RECORD
    with pytest.raises(ValueError, match="not a weights fingerprint"):
        WeightsFingerprint.from_json('{"prompt_ids": [1]}')
