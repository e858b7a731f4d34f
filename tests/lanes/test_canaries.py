"""Which samples the canary checks (lanes/canaries.py: drawn from the shard id, followers first, across lengths, the
longest now and then, never more than `count` samples' states held) and which of their tokens matter (the
completion, and past the prefix a sample shares with another). The check itself on real engines:
tests/lanes/test_extract_checks.py, tests/engines/vllm/test_vllm_extract_bfloat16.py, tests/engines/test_canary_trained.py."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from dflash_queue.config import load_config
from dflash_queue.engines.base import ExtractionRequest
from dflash_queue.errors import ConfigError
from dflash_queue.lanes.canaries import (
    STRATA,
    CanaryPicker,
    length_strata,
    longest_due,
    shared_prefix,
    token_focus,
    window_canary_due,
)
from dfq_testing.configs import tiny_config_tables, write_config

LENGTHS = [30, 400, 55, 1200, 80, 260, 45, 700, 120, 90, 3000, 150]


def pick(shard_id: str, lengths=LENGTHS, count: int = 1, longest_every: int = 0, positions=None, order=None):
    """The picker fed every sample (in `order`, at its pass position: a follower unless said otherwise); returns
    the picked indices and the most states it held at once."""
    picker = CanaryPicker(shard_id, lengths, count, longest_every)
    held = 0
    for index in order or range(len(lengths)):
        picker.offer(index, torch.full((lengths[index], 1, 1), float(index)), (positions or {}).get(index, 1))
        held = max(held, picker.held)
    chosen = picker.chosen(range(len(lengths)))
    assert all(float(states[0, 0, 0]) == index for index, states, _ in chosen)  # each its own states
    return [index for index, _, _ in chosen], held, picker


def test_strata_rank_the_samples_by_length_in_equal_shares():
    strata = length_strata(LENGTHS)
    assert Counter(strata) == {s: len(LENGTHS) // STRATA for s in range(STRATA)}
    ranked = sorted(range(len(LENGTHS)), key=lambda i: LENGTHS[i])
    assert [strata[i] for i in ranked] == sorted(strata)
    assert length_strata([5, 5]) == [0, 1] and length_strata([7]) == [0]


def test_each_shard_checks_a_follower_of_a_length_stratum_drawn_from_its_id():
    seen = Counter()
    for number in range(400):
        shard_id = f"shard-{number}"
        [index], held, picker = pick(shard_id)
        assert held == 1 and pick(shard_id)[0] == [index]  # a re-delivery picks the same
        assert length_strata(LENGTHS)[index] == picker.stratum
        seen[picker.stratum] += 1
    assert set(seen) == set(range(STRATA)) and min(seen.values()) > 60  # every stratum, about equally often
    # The longest quarter is checked too, not only samples up to the median.
    assert any(LENGTHS[pick(f"shard-{n}")[0][0]] > sorted(LENGTHS)[len(LENGTHS) // 2] for n in range(20))


def test_followers_come_first_then_the_drawn_stratum():
    shard_id = "shard-followers"
    _, _, picker = pick(shard_id)
    strata = length_strata(LENGTHS)
    in_stratum = [i for i in range(len(LENGTHS)) if strata[i] == picker.stratum]
    # None of the drawn stratum followed another: a follower of another stratum is checked instead.
    first_in_pass = {i: 0 for i in in_stratum}
    [index], _, _ = pick(shard_id, positions=first_in_pass)
    assert index not in in_stratum
    # No follower anywhere: a sample of the drawn stratum all the same.
    [index], _, _ = pick(shard_id, positions={i: 0 for i in range(len(LENGTHS))})
    assert index in in_stratum


def test_one_shard_in_n_checks_its_longest_sample_that_followed_another():
    longest = LENGTHS.index(max(LENGTHS))
    runner_up = LENGTHS.index(sorted(LENGTHS)[-2])
    due = [f"shard-{n}" for n in range(400) if longest_due(f"shard-{n}", 8)]
    assert 25 <= len(due) <= 75  # about one in 8
    # Drawn apart from the window canary's shards.
    assert {f"shard-{n}" for n in range(400) if window_canary_due(f"shard-{n}", 8)} != set(due)
    everyone_first = {i: 0 for i in range(len(LENGTHS))}
    for shard_id in due[:10]:
        # Every sequence followed another (the vLLM engine): the shard's longest, offered last or first.
        for order in (None, [longest] + [i for i in range(len(LENGTHS)) if i != longest]):
            [index], held, picker = pick(shard_id, longest_every=8, order=order)
            assert index == longest and held == 1
            assert picker.describe(range(len(LENGTHS)))["long"] == {"tokens": 3000, "shard_longest": 3000}
        # The longest ran first in its pass (the Transformers engine packs it first): the longest that followed.
        [index], _, picker = pick(shard_id, longest_every=8, positions={longest: 0})
        assert index == runner_up
        assert picker.describe(range(len(LENGTHS)))["long"] == {"tokens": 1200, "shard_longest": 3000}
        # None followed another: the longest all the same.
        assert pick(shard_id, longest_every=8, positions=everyone_first)[0] == [longest]
        # Two places: the long one and a follower of the drawn stratum.
        chosen, held, picker = pick(shard_id, count=2, longest_every=8, positions={longest: 0})
        assert runner_up in chosen and held == 2 and len(chosen) == 2
        [other] = [i for i in chosen if i != runner_up]
        assert length_strata(LENGTHS)[other] == picker.stratum
    not_due = next(f"shard-{n}" for n in range(400) if not longest_due(f"shard-{n}", 8))
    _, _, picker = pick(not_due, longest_every=8)
    assert "long" not in picker.describe(range(len(LENGTHS)))
    assert not longest_due("any", 0)


def test_never_more_than_count_samples_states_are_held():
    for number in range(50):
        for count in (1, 2, 3):
            for positions in (None, {i: i % 2 for i in range(12)}):
                chosen, held, _ = pick(f"shard-{number}", count=count, longest_every=2, positions=positions,
                                       order=list(reversed(range(12))))
                assert held <= count and len(chosen) == count
    assert pick("shard-0", count=0, longest_every=1)[0] == []


def request(sample_id: str, ids: list[int]) -> ExtractionRequest:
    return ExtractionRequest(sample_id, ids)


def test_the_shared_prefix_is_the_longest_one_with_any_other_request_of_the_shard():
    system = list(range(100, 400))
    requests = [
        request("a", system + [1, 2, 3, 4]),
        request("b", system + [1, 2, 9, 9, 9]),
        request("c", system[:50] + [7] * 10),
        request("d", [5] * 20),
        request("a", system + [1, 2, 3, 4, 5, 6]),  # a later turn of "a": the earlier turn is its prefix
    ]
    assert [shared_prefix(requests, i) for i in range(len(requests))] == [304, 302, 50, 0, 304]
    focus = token_focus(requests, 0, [[0] * 300 + [1] * 4, None, None, None, None])
    assert focus.shared_prefix == 304 and focus.tokens == 4  # the turn's own completion, all inside the prefix
    focus = token_focus(requests, 1, None)  # no loss masks: past the shared prefix only
    assert focus.mask.tolist() == [False] * 302 + [True] * 3
    assert shared_prefix([request("x", [1, 2, 3])], 0) == 0


@pytest.fixture
def config_with(tmp_path: Path):
    """A config whose [extract] table is given these keys, loaded as a user's would be."""
    (tmp_path / "model").mkdir()
    tables = tiny_config_tables(tmp_path / "model", tmp_path / "storage", "redis://127.0.0.1:1/0", tmp_path / "state")

    def load(**extract):
        return load_config(write_config(tmp_path / "config.toml", tables, extract=extract))

    return load


def test_a_canary_tolerance_above_every_ceiling_and_a_window_below_the_count_are_refused_at_load(config_with):
    assert config_with().extract.canary_tolerance == 0 and config_with(canary_tolerance=0.25).extract
    with pytest.raises(ConfigError, match=r"extract\.canary_tolerance: Input should be less than or equal to 0\.25"):
        config_with(canary_tolerance=0.3)
    extract = config_with().extract
    assert (extract.stop_after_failed_checks, extract.failed_checks_window, extract.canary_longest_every) == (3, 10, 8)
    assert config_with(stop_after_failed_checks=4, failed_checks_window=4).extract.failed_checks_window == 4
    assert config_with(stop_after_failed_checks=0, failed_checks_window=1).extract.stop_after_failed_checks == 0
    with pytest.raises(ConfigError, match=r"extract\.failed_checks_window \(4\) must be at least "
                                          r"extract\.stop_after_failed_checks \(5\)"):
        config_with(stop_after_failed_checks=5, failed_checks_window=4)
