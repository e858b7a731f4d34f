"""The inference-server engine against a fleet that changes under it: fake SGLang servers as processes of their own
(dfq_testing/fake_sglang_process.py), restarted behind the same URL with other weights, switched to other weights
in place (a balancer routing to another replica), without a tokenize endpoint, failing every generation while their
health check passes."""

from __future__ import annotations

import logging
import threading
from pathlib import Path

import pytest

from dflash_queue.data.samples import Message, Sample
from dflash_queue.engines.base import GenerationRequest
from dflash_queue.engines.config import GenerateConfig
from dflash_queue.engines.server.fingerprint import WeightsFingerprint
from dflash_queue.engines.server.generate import ServedTarget, ServerGenerateEngine
from dflash_queue.errors import ConfigError
from dflash_queue.lanes.generate import build_generate_lane
from dflash_queue.runstate.ledger import resilient_client
from dflash_queue.runstate.served_weights import ServedWeights
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key
from dflash_queue.storage import open_storage
from dfq_testing.fake_sglang_process import FakeSglangProcess
from dfq_testing.jobs import stage_samples
from dfq_testing.polling import wait_until

SAMPLING = {"temperature": 1.0, "top_p": 0.9, "top_k": 30, "min_p": 0.05, "max_tokens": 16, "seed": 11}


class Fleet:
    """Fake SGLang server processes, each killed when the test ends (and any started in its place)."""

    def __init__(self, tokenizer: Path, logs: Path) -> None:
        self.tokenizer, self.logs = tokenizer, logs
        self.made: list[FakeSglangProcess] = []

    def __call__(self, **settings) -> FakeSglangProcess:
        return self._keep(FakeSglangProcess(self.tokenizer, self.logs / f"fake-{len(self.made)}.log", **settings).start())

    def replaced(self, server: FakeSglangProcess, **settings) -> FakeSglangProcess:
        return self._keep(server.replaced(**settings))

    def _keep(self, server: FakeSglangProcess) -> FakeSglangProcess:
        self.made.append(server)
        return server

    def kill(self) -> None:
        for server in self.made:
            server.kill()


@pytest.fixture
def fleet(tiny_model, tmp_path):
    made = Fleet(tiny_model, tmp_path)
    yield made
    made.kill()


def engine_on(tiny_model: Path, *servers: FakeSglangProcess, served_weights=None, **settings) -> ServerGenerateEngine:
    config = GenerateConfig.model_validate({
        "engine": "server",
        "server": {"urls": [s.url for s in servers], "kind": "sglang", "model": "tiny-qwen3",
                   "backoff_initial_s": 0.05, "backoff_max_s": 0.2, **settings},
        "sampling": SAMPLING,
    })
    return ServerGenerateEngine(
        config.server, config.sampling, ServedTarget("tiny-qwen3", str(tiny_model), 1024),
        served_weights=served_weights,
    )


def requests(count: int) -> list[GenerationRequest]:
    return [GenerationRequest(f"s{i}", [100 + i, 200 + i, 300, 400]) for i in range(count)]


def state_of(engine: ServerGenerateEngine, url: str):
    (server,) = [s for s in engine.servers() if s.url == url]
    return server


def refusal(engine: ServerGenerateEngine, url: str) -> str | None:
    """Why the server is refused, once it is refused for its weights."""
    server = state_of(engine, url)
    return server.reason if not server.up and "other weights" in server.reason else None


def test_a_server_with_other_weights_behind_its_url_is_refused_at_its_periodic_check(tiny_model, fleet):
    first, second = fleet(weights="w1"), fleet(weights="w1")
    engine = engine_on(tiny_model, first, second, recheck_interval_s=1.0)
    try:
        expected = engine.generate(requests(12))
        assert first.generate_requests() > 2 and second.generate_requests() > 2  # both served the job
        # Other weights behind the URL while nothing is in flight (a balancer routing to an upgraded replica): no
        # connection breaks, the health check passes, only the periodic check can tell.
        first.switch_weights("w2")
        refused = wait_until(lambda: refusal(engine, first.url), 12, "the periodic check's refusal")
        assert "it runs other weights than the run's" in refused and "failed its periodic check" in refused
        assert engine.generate(requests(12)) == expected  # every reply from the weights the run started with
        assert state_of(engine, second.url).up
    finally:
        engine.close()


def test_a_server_restarted_with_other_weights_mid_request_has_none_of_its_replies_kept(tiny_model, fleet):
    first, second = fleet(weights="w1"), fleet(weights="w1")
    engine = engine_on(tiny_model, first, second, recheck_interval_s=0)
    try:
        expected = engine.generate(requests(12))
        first.set_faults(delay_s=1.0)
        second.set_faults(delay_s=0.3)
        before = first.generate_requests()
        result: dict = {}
        thread = threading.Thread(target=lambda: result.update(out=engine.generate(requests(12))))
        thread.start()
        wait_until(lambda: first.generate_requests() > before, 10, "requests in flight at the first server")
        restarted = fleet.replaced(first, weights="w2")  # the connections in flight break
        thread.join(60)
        assert result["out"] == expected
        refused = wait_until(lambda: refusal(engine, restarted.url), 20, "the restarted server refused")
        assert "greedy token" in refused
        assert engine.generate(requests(12)) == expected
    finally:
        engine.close()


def test_a_broken_connection_has_the_server_checked_before_its_next_request(tiny_model, fleet):
    """A balancer whose replica died mid-request and that routes to a replica with other weights from then on: the
    URL answers its health check throughout, and only the broken connection tells."""
    first, second = fleet(weights="w1"), fleet(weights="w1")
    engine = engine_on(tiny_model, first, second, recheck_interval_s=0, requests_in_flight=1)
    try:
        expected = engine.generate(requests(8))
        first.switch_weights("w2")
        first.set_faults(drop_next=1)
        assert engine.generate(requests(8)) == expected
        refused = state_of(engine, first.url)
        assert not refused.up and "it runs other weights than the run's" in refused.reason
    finally:
        engine.close()


def test_a_server_without_a_tokenize_endpoint_gets_one_clear_warning_at_start(tiny_model, fleet, caplog):
    server = fleet(weights="w1", tokenize=False)
    caplog.set_level(logging.WARNING, logger="dflash_queue")
    engine = engine_on(tiny_model, server, recheck_interval_s=0.2)
    try:
        served = server.generate_requests()
        wait_until(lambda: server.generate_requests() >= served + 4, 10, "two periodic checks")
        assert len(engine.generate(requests(2))) == 2
        unchecked = state_of(engine, server.url).unchecked
    finally:
        engine.close()
    warnings = [r.getMessage() for r in caplog.records if "/tokenize" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"inference server {server.url} has no tokenize endpoint (/tokenize)" in warnings[0]
    assert "its tokenizer cannot be checked against the local one (model.tokenizer)" in warnings[0]
    assert unchecked == ("its tokenizer is not checked: it has no tokenize endpoint (/tokenize)",)


def test_the_run_records_the_weights_and_refuses_a_worker_whose_server_runs_other_weights(
    make_config, fleet, redis_url
):
    first, other = fleet(weights="w1"), fleet(weights="w2")
    config = fleet_config(make_config, first)
    record = ServedWeights(resilient_client(redis_url), config.run.name)
    assert record.recorded() is None
    lane = build_generate_lane(config, open_storage(config.storage))
    lane.close()
    recorded = WeightsFingerprint.from_json(record.recorded())
    assert recorded.server == first.url and len(recorded.tokens) >= 1
    assert all(t.runner_up is not None and t.runner_up < t.logprob for t in recorded.tokens)

    with pytest.raises(ConfigError, match="no inference server can serve tiny-qwen3") as refused:
        build_generate_lane(fleet_config(make_config, other, name="second.toml"))
    assert f"{other.url}: it runs other weights than the run's" in str(refused.value)
    assert f"recorded from {first.url}" in str(refused.value)
    assert WeightsFingerprint.from_json(record.recorded()) == recorded  # the record stays the first one's

    # A server of the same weights whose logprobs move with its batches passes; one further off does not.
    same = fleet(weights="w1", noise=0.01)
    build_generate_lane(fleet_config(make_config, same, name="third.toml")).close()
    shifted = fleet(weights="w1", logprob_shift=0.3)
    with pytest.raises(ConfigError, match=r"its logprob is .*0\.3000 apart, more than generate.server.fingerprint"):
        build_generate_lane(fleet_config(make_config, shifted, name="fourth.toml"))


def fleet_config(make_config, *servers: FakeSglangProcess, name: str = "config.toml", **server):
    return make_config(
        name, generate={"engine": "server"},
        **{"generate.server": {"urls": [s.url for s in servers], "kind": "sglang", "model": "tiny-qwen3",
                               "backoff_initial_s": 0.05, "backoff_max_s": 0.2, **server},
           "generate.sampling": SAMPLING, "dataset": {"shard_size": 8, "thinking": "always", "max_model_len": 1024}},
    )


def test_a_5xx_storm_from_a_server_whose_health_passes_opens_its_breaker_and_costs_no_tries(
    tiny_model, fleet, caplog
):
    first, second = fleet(weights="w1"), fleet(weights="w1")
    caplog.set_level(logging.WARNING, logger="dflash_queue")
    engine = engine_on(tiny_model, first, second, max_tries=2, breaker_failures=3)
    try:
        expected = engine.generate(requests(16))
        first.set_faults(fail_next=10**6)
        assert engine.generate(requests(16)) == expected  # none given up: the other server took them
        assert not state_of(engine, first.url).up  # its checks fail too (their generation answers 500)
    finally:
        engine.close()
    opened = [r.getMessage() for r in caplog.records if "breaker open" in r.getMessage()]
    assert opened and f"inference server {first.url} is down (breaker open: 3 requests in a row failed while its " \
        "health check passed (the last: answered 500: Internal server error" in opened[0]


def test_a_storm_costs_a_request_no_tries_and_a_failed_trial_costs_it_one(tiny_model, fleet):
    """One request at a time on one server that fails long generations only (its checks pass): the request's first
    failure is a try; its second opens the breaker, which gives the first back; the trial after the check fails (a
    try); then one succeeds. Two tries would have given it up."""
    server = fleet(weights="w1")
    engine = engine_on(tiny_model, server, max_tries=2, breaker_failures=2, requests_in_flight=1)
    try:
        expected = engine.generate(requests(1))
        server.set_faults(fail_next_long=3)
        assert engine.generate(requests(1)) == expected
    finally:
        engine.close()


def test_a_5xx_storm_on_the_only_server_makes_its_samples_wait_not_dead_lettered(make_config, fleet):
    server = fleet(weights="w1")
    config = fleet_config(make_config, server, max_tries=2, breaker_failures=3)
    samples = [Sample(f"storm-{i}", (Message("user", f"Tell me about topic {i}."),), "test") for i in range(8)]
    storage = open_storage(config.storage)
    shard_id = stage_samples(storage, samples)
    lane = build_generate_lane(config, storage)
    try:
        # Far more failures in a row than the samples have tries among them (the lane's own reruns included).
        server.set_faults(fail_next=60)
        summary = lane.run(shard_id)
    finally:
        lane.close()
    assert dict(summary.poisoned) == {}
    stored = decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id)
    assert [r.id for r in stored] == [s.id for s in samples]
