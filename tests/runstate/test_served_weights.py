"""The run's record of its inference servers' weights fingerprint, on a real redis-server: the first claim is kept,
and starting the run over clears it."""

from __future__ import annotations

from dflash_queue.runstate.ledger import Ledger, resilient_client
from dflash_queue.runstate.served_weights import ServedWeights


def test_the_first_fingerprint_claimed_is_the_one_kept(redis_url):
    record = ServedWeights(resilient_client(redis_url), "weights-run")
    assert record.recorded() is None
    assert record.claim('{"server": "a"}') is None  # recorded: none was before
    assert record.claim('{"server": "b"}') == '{"server": "a"}'  # another worker gets the first one back
    assert record.recorded() == '{"server": "a"}'
    assert ServedWeights(resilient_client(redis_url), "other-run").recorded() is None


def test_starting_the_run_over_clears_the_record(redis_url):
    client = resilient_client(redis_url)
    record = ServedWeights(client, "rebuilt-run")
    record.claim('{"server": "a"}')
    Ledger(client, "rebuilt-run").reset()
    assert record.recorded() is None
    assert record.claim('{"server": "b"}') is None
