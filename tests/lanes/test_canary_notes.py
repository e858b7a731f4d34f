"""The canary's counters in words, as `run`'s summary and `status` both print them."""

from __future__ import annotations

from dflash_queue.lanes.canary_notes import canary_summary


def test_the_summary_says_how_many_samples_were_rerun_the_worst_error_and_what_was_left_unchecked():
    assert canary_summary(0, None, 0, 0) is None
    assert canary_summary(3, None, 0, 0) is None  # counted, but no error recorded yet
    assert canary_summary(1234, 3.25e-6, 0, 0) == "1,234 samples rerun alone, worst relative error 3.25e-06"
    assert canary_summary(2, 0.5, 1, 3) == (
        "2 samples rerun alone, worst relative error 5.00e-01; 1 shard(s) untestable (no sample followed another in "
        "its pass); 3 past the window"
    )
