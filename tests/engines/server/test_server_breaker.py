"""A server's breaker: it opens after a storm of failures, lets one trial request through once the server passed its
check, and a request's tries spent on a server whose breaker then opened in a storm are not counted."""

from __future__ import annotations

from dflash_queue.engines.server.breaker import CLOSED, OPEN, TRIAL, Breaker, Tries


def test_a_storm_opens_the_breaker_and_a_trial_closes_it():
    breaker = Breaker(threshold=3)
    assert [breaker.failed() for _ in range(3)] == ["", "", "storm"]
    assert breaker.state == OPEN and not breaker.admits(0)
    assert breaker.passed_check() and breaker.state == TRIAL
    assert breaker.admits(0) and not breaker.admits(1)  # one trial request at a time
    assert breaker.succeeded() and breaker.state == CLOSED and breaker.admits(5)


def test_a_success_between_failures_keeps_it_closed():
    breaker = Breaker(threshold=3)
    breaker.failed(), breaker.failed()
    assert not breaker.succeeded()
    assert breaker.failed() == "" and breaker.state == CLOSED


def test_a_failed_trial_opens_it_again_for_twice_as_long():
    breaker = Breaker(threshold=2)
    breaker.failed(), breaker.failed()
    assert breaker.open_for_s(1.0, 30.0) == 1.0
    breaker.passed_check()
    assert breaker.failed() == "trial" and breaker.state == OPEN
    assert breaker.open_for_s(1.0, 30.0) == 2.0
    assert breaker.open_for_s(1.0, 1.5) == 1.5


def test_tries_spent_before_a_storm_on_their_server_do_not_count():
    stormy, steady = Breaker(threshold=2), Breaker(threshold=2)
    tries = Tries()
    tries.spend(stormy)
    tries.spend(steady)
    assert tries.counted() == 2
    stormy.failed(), stormy.failed()  # other requests' failures open it
    assert tries.counted() == 1
    stormy.passed_check()
    stormy.failed()  # a failed trial is the request's own
    tries.spend(stormy)
    assert tries.counted() == 2
