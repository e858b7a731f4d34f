"""Deliveries counted in a real redis-server, the limit on them, and a handed-back delivery uncounted."""

from __future__ import annotations

import redis

from dflash_queue.queue.config import BrokerConfig
from dflash_queue.queue.steps.deliveries import DeliveryCount, DeliveryLimitExceeded
from dflash_queue.runstate.ledger import Ledger


def test_a_message_delivered_more_often_than_the_limit_is_refused_and_a_retry_counts_afresh(redis_url):
    ledger = Ledger.from_url(redis_url, "r")
    delivery = DeliveryCount(ledger, BrokerConfig(max_deliveries=2), "t1", 0)
    counts = [delivery.count() for _ in range(3)]
    assert counts == [1, 2, 3]
    assert delivery.limit_exceeded(1) is None and delivery.limit_exceeded(2) is None
    refused = delivery.limit_exceeded(3)
    assert isinstance(refused, DeliveryLimitExceeded)
    assert str(refused).startswith("delivered 3 times (broker.max_deliveries = 2); the workers that ran it died")
    assert DeliveryCount(ledger, BrokerConfig(max_deliveries=2), "t1", 1).count() == 1
    assert ledger.deliveries() == {("t1", 0): 3, ("t1", 1): 1}


def test_a_delivery_handed_back_unrun_is_uncounted(redis_url):
    ledger = Ledger.from_url(redis_url, "r")
    delivery = DeliveryCount(ledger, BrokerConfig(), "t1", 0)
    delivery.count()
    delivery.count()
    delivery.uncount()
    assert ledger.deliveries() == {("t1", 0): 1}


class BrokerGone:
    def count_delivery(self, task_id: str, retries: int = 0, *, by: int = 1) -> int:
        raise redis.ConnectionError("the broker is gone")


def test_uncounting_never_raises_when_the_broker_is_gone():
    DeliveryCount(BrokerGone(), BrokerConfig(), "t1", 0).uncount()
