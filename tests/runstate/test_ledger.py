"""The ledger's counters and windowed rates, on a real redis-server, with explicit timestamps."""

from __future__ import annotations

import pytest
import redis

from dflash_queue.runstate.ledger import RATE_BUCKET_S, RATE_RETENTION_S, Ledger

START = 28_333_333 * 60.0  # the start of a minute (November 2023)


def test_window_sums_recent_buckets_over_the_time_they_cover(redis_url):
    ledger = Ledger.from_url(redis_url, "rates")
    ledger.add({"generate_completion_tokens": 1000, "generate_samples": 4}, now=START - 3600)  # an hour before
    ledger.add({"generate_completion_tokens": 600}, now=START + 5)
    ledger.add({"generate_completion_tokens": 300, "generate_samples": 2}, now=START + 65)
    ledger.add({"extract_bytes": 7}, now=START + 130)

    # A 2-minute window at START+150 covers the buckets of minutes START+60 and START+120: 90 s of time.
    window = ledger.window(120, now=START + 150)
    assert window.totals == {"generate_completion_tokens": 300, "generate_samples": 2, "extract_bytes": 7}
    assert window.span_s == pytest.approx(90.0)
    assert window.rate("generate_completion_tokens") == pytest.approx(300 / 90)
    assert window.rate("absent") == 0.0

    # A 10-minute window covers START-420 .. START+150 (570 s) and the hour-old add is outside it.
    wide = ledger.window(600, now=START + 150)
    assert wide.totals["generate_completion_tokens"] == 900
    assert wide.span_s == pytest.approx(570.0)

    # Totals are not windowed.
    assert ledger.counters()["generate_completion_tokens"] == 1900


def test_a_young_run_is_measured_from_its_first_progress(redis_url):
    ledger = Ledger.from_url(redis_url, "young")
    ledger.add({"enqueued_samples": 100}, now=START + 20)  # the producer's add opens the run
    ledger.add({"generate_samples": 50}, now=START + 80)
    window = ledger.window(600, now=START + 120)
    assert window.span_s == pytest.approx(100.0)  # from START+20, not from the start of the window
    assert window.rate("generate_samples") == pytest.approx(0.5)


def test_counters_and_buckets_live_in_redis_and_expire(redis_url):
    Ledger.from_url(redis_url, "persist").add({"extract_tokens": 42}, now=START)
    again = Ledger.from_url(redis_url, "persist")  # another process, e.g. after a worker restart
    assert again.counters() == {"extract_tokens": 42}
    assert again.window(60, now=START + 30).totals == {"extract_tokens": 42}
    client = redis.Redis.from_url(redis_url)
    ttl = client.ttl(f"dfq:persist:rate:{int(START // RATE_BUCKET_S)}")
    assert 0 < ttl <= RATE_RETENTION_S + RATE_BUCKET_S
    again.reset()
    assert again.counters() == {} and again.window(60, now=START + 30).totals == {}
    assert not list(client.scan_iter(match="dfq:persist:*"))


def test_zero_counts_write_nothing_and_windows_are_bounded(redis_url):
    ledger = Ledger.from_url(redis_url, "zero")
    ledger.add({"generate_samples": 0}, now=START)
    assert not redis.Redis.from_url(redis_url).keys("dfq:zero:*")
    with pytest.raises(ValueError, match="window"):
        ledger.window(RATE_RETENTION_S + 1)
    with pytest.raises(ValueError, match="window"):
        ledger.window(0)


def test_maxima_keep_the_largest_value_recorded(redis_url):
    ledger = Ledger(redis.Redis.from_url(redis_url, decode_responses=True), "maxima")
    assert ledger.maxima() == {}
    for value in (3e-7, 1.5e-6, 2e-7, 1.5e-6):
        ledger.record_max("extract_canary_error", value)
    ledger.record_max("other", 0.0)
    assert ledger.maxima() == {"extract_canary_error": 1.5e-6, "other": 0.0}
    ledger.reset()
    assert ledger.maxima() == {}
