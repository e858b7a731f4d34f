"""Connection URLs of a broker behind Redis Sentinel: what they name, and the errors of one that is wrong."""

from __future__ import annotations

import pytest

from dflash_queue.runstate.redis_connect import SentinelTarget, kombu_broker, parse_sentinel_url, redis_client


def test_a_target_survives_its_url():
    target = SentinelTarget((("127.0.0.1", 26379), ("::1", 26380)), "dfq", db=3, username="u s",
                            password="p;w/d?#", sentinel_password="s&p=")
    assert parse_sentinel_url(target.url()) == target
    bare = SentinelTarget((("h", 1),), "dfq")
    assert bare.url() == "sentinel://h:1/0?master_name=dfq" and parse_sentinel_url(bare.url()) == bare


def test_kombu_gets_the_addresses_without_the_query():
    url = SentinelTarget((("a", 1), ("b", 2)), "dfq", password="pw", sentinel_password="sp").url()
    assert kombu_broker(url) == ("sentinel://:pw@a:1;sentinel://:pw@b:2/0",
                                 {"master_name": "dfq", "sentinel_kwargs": {"password": "sp"}})
    assert kombu_broker("redis://h:1/0") == ("redis://h:1/0", {})


@pytest.mark.parametrize(
    ("url", "said"),
    [
        ("sentinel://a:1/0", "needs ?master_name=NAME"),
        ("sentinel://a:1;redis://b:2/0?master_name=m", "must be sentinel://HOST:PORT"),
        ("sentinel://a:1/x?master_name=m", "must be a number, got 'x'"),
    ],
)
def test_a_wrong_url_says_what_is_wrong(url, said):
    with pytest.raises(ValueError, match=said.replace("?", r"\?")):
        parse_sentinel_url(url)


def test_a_sentinel_client_finds_no_master_where_no_sentinel_answers():
    import redis

    client = redis_client("sentinel://127.0.0.1:1/0?master_name=m", socket_connect_timeout=0.2)
    with pytest.raises(redis.ConnectionError, match="No master found for 'm'"):
        client.ping()
