"""Broker checks against real redis-servers: AOF on and off, another eviction policy, nothing listening."""

from __future__ import annotations

import redis

from dflash_queue.broker.redis_server import RedisServer, free_port
from dflash_queue.doctor.broker import check_broker, durability_warnings, is_loopback, login_error, password_verdict
from dfq_testing.jobs import connect


def verdicts(checks) -> dict[str, str]:
    return {c.name: c.verdict for c in checks}


def test_a_durable_broker_passes(redis_server):
    checks = check_broker(redis_server.url)
    assert verdicts(checks) == {
        "broker reachable": "pass", "broker password": "pass", "broker AOF": "pass", "broker eviction": "pass"
    }
    assert "redis " in checks[0].detail


def test_a_broker_without_aof_or_with_eviction_fails(tmp_path):
    with RedisServer(tmp_path / "no-aof", appendonly=False) as server:
        checks = verdicts(check_broker(server.url))
        assert checks == {
            "broker reachable": "pass", "broker password": "pass", "broker AOF": "fail", "broker eviction": "pass"
        }
    with RedisServer(tmp_path / "lru", appendonly=True) as server:
        redis.Redis.from_url(server.url).config_set("maxmemory-policy", "allkeys-lru")
        checks = check_broker(server.url)
        assert verdicts(checks)["broker eviction"] == "fail"
        assert "allkeys-lru" in [c for c in checks if c.name == "broker eviction"][0].detail


def test_an_unreachable_or_missing_broker():
    checks = check_broker(f"redis://:pw@127.0.0.1:{free_port()}/0", timeout_s=1)
    assert [(c.name, c.verdict) for c in checks] == [("broker reachable", "fail")]
    assert ":***@" in checks[0].detail and ":pw@" not in checks[0].detail
    assert [c.verdict for c in check_broker("")] == ["warn"]


def test_durability_warnings_name_each_unsafe_setting(redis_server, tmp_path):
    assert durability_warnings(redis_server.url) == []
    with RedisServer(tmp_path / "unsafe", appendonly=False) as server:
        [no_aof] = durability_warnings(server.url)
        assert no_aof.startswith("broker AOF: appendonly no")
        redis.Redis.from_url(server.url).config_set("maxmemory-policy", "allkeys-lru")
        warnings = durability_warnings(server.url)
        assert warnings[0] == no_aof
        assert warnings[1].startswith("broker eviction: maxmemory-policy allkeys-lru")
        assert len(warnings) == 2
    # Reachability is the worker connection's business, not a durability warning.
    assert durability_warnings(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1) == []
    assert durability_warnings("") == []


def test_worker_start_up_logs_a_warning_per_unsafe_setting(make_config, tmp_path, start_worker):
    with RedisServer(tmp_path / "unsafe-broker", appendonly=False) as server:
        redis.Redis.from_url(server.url).config_set("maxmemory-policy", "allkeys-lru")
        config = make_config(broker={"url": server.url})
        connect(config)
        worker = start_worker(config, "generate")
        log = worker.log_tail(100_000)
        worker.stop(timeout=30)
    connect(make_config())  # later tests talk to the session's broker again
    lines = log.splitlines()
    assert any("WARNING" in line and "] broker AOF: appendonly no" in line for line in lines), log[:3000]
    assert any("WARNING" in line and "] broker eviction: maxmemory-policy allkeys-lru" in line for line in lines), log[:3000]


def test_a_durable_broker_gives_the_worker_nothing_to_warn_about(make_config, start_worker):
    worker = start_worker(make_config(), "generate")
    assert "broker AOF" not in worker.log_tail(100_000) and "broker eviction" not in worker.log_tail(100_000)


def test_the_password_verdict():
    # Answering without a password is fine on loopback only.
    for host in ("127.0.0.1", "127.0.0.53", "::1", "localhost", ""):
        assert is_loopback(host), host
        assert password_verdict(host, needs_password=False).verdict == "pass"
    for host in ("10.0.0.5", "192.168.1.2", "0.0.0.0", "2001:db8::1", "broker.invalid"):
        assert not is_loopback(host), host
        check = password_verdict(host, needs_password=False)
        assert (check.name, check.verdict) == ("broker password", "warn")
        assert host in check.detail and "without a password" in check.detail and "DFQ_BROKER_PASSWORD" in check.detail
    for host in ("10.0.0.5", "127.0.0.1"):
        assert password_verdict(host, needs_password=True).verdict == "pass"


def test_a_broker_that_needs_a_password_and_a_wrong_one(tmp_path):
    with RedisServer(tmp_path / "locked", password="doctor-Secret-4", users={"worker": "worker-Secret-5"}) as server:
        host_port = server.url.removeprefix("redis://")
        # The checks log in as the worker would; the password check tries without any credentials.
        for url in (f"redis://:doctor-Secret-4@{host_port}", f"redis://worker:worker-Secret-5@{host_port}"):
            checks = check_broker(url)
            assert verdicts(checks)["broker password"] == "pass"
            assert "refuses clients without a password" in checks[1].detail
            assert all("Secret" not in c.detail for c in checks)
            assert login_error(url) is None
        wrong = f"redis://worker:not-the-Secret@{host_port}"
        refused = login_error(wrong)
        assert refused is not None and "refuses user 'worker'" in refused and "DFQ_BROKER_PASSWORD" in refused
        assert "Secret" not in refused
        assert "refuses the default user" in (login_error(server.url) or "")
        assert [(c.name, c.verdict) for c in check_broker(wrong)] == [("broker reachable", "fail")]
        assert "Secret" not in check_broker(wrong)[0].detail
    # Nothing listening: not a login problem (the connection's retries say that).
    assert login_error(f"redis://127.0.0.1:{free_port()}/0", timeout_s=1) is None
