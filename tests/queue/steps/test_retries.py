from __future__ import annotations

import random

from dflash_queue.queue.steps.retries import backoff_s


def test_retry_delays_grow_exponentially_with_full_jitter_between_one_second_and_the_cap():
    random.seed(0)
    for attempt in range(12):
        bound = min(2 * 2**attempt, 120)
        delays = [backoff_s(attempt, 120.0) for _ in range(400)]
        assert all(1 <= d <= bound for d in delays), (attempt, min(delays), max(delays))
        # Full jitter: the delays spread over the whole range, not only its top half.
        assert max(delays) == bound and min(delays) <= max(1, bound // 4)
