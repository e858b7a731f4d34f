"""`dflash-queue metrics` scraped over HTTP, each figure compared with what `status --json` says of the same run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from dflash_queue.broker.redis_server import free_port
from dflash_queue.deadletters import TASK, DeadLetter, DeadLetters, record_id
from dflash_queue.ops.metrics import StatusCollector, serve_metrics, status_families
from dflash_queue.ops.status import WorkerView, collect_status
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.runstate.audits import AuditRecords
from dflash_queue.runstate.ledger import DONE, GENERATED, Ledger
from dflash_queue.runstate.server_waits import ServerWaits
from dflash_queue.runstate.shard_states import CANARY_ERROR
from dflash_queue.runstate.stopped_workers import StoppedWorker, StoppedWorkers
from dflash_queue.runstate.window import ShardWindow
from dflash_queue.shards.keys import shard_key
from dflash_queue.storage import open_storage
from dfq_testing.commands import dflash_queue
from dfq_testing.polling import wait_for_states

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
DASHBOARD = REPO / "docs" / "grafana-dashboard.json"
P = "dflash_queue_"
# Status's lane totals by label, as the metric (and its `kind` label) that carries each.
TOTALS = {
    "samples": ("samples_total", {}),
    "prompt_tokens": ("tokens_total", {"kind": "prompt"}),
    "generated_tokens": ("tokens_total", {"kind": "generated"}),
    "tokens": ("tokens_total", {"kind": "sequence"}),
    "bytes": ("stored_bytes_total", {}),
}
RATES = {
    "samples": "samples_per_second",
    "prompt_tokens": "tokens_per_second",
    "generated_tokens": "tokens_per_second",
    "tokens": "tokens_per_second",
    "bytes": "stored_bytes_per_second",
}
# Rates drift as the window's span grows between two snapshots: compared as rate × span, the window's increment.
RATE_METRICS = {P + name for name in RATES.values()}


def expected_from_status(snapshot: dict) -> dict[tuple[str, frozenset], float]:
    """What the scrape must hold, read off `status --json` field by field: (sample name, labels) -> value."""
    run = snapshot["run"]
    expected: dict[tuple[str, frozenset], float] = {}

    def put(name: str, value, **labels: str) -> None:
        if value is not None:
            expected[(P + name, frozenset({"run": run, **labels}.items()))] = float(value)

    def queue_and_volume(lane: str, section: dict, totals: dict, rates: dict) -> None:
        put("queue_depth", section["queued"], lane=lane)
        put("unacked_messages", section["reserved"], lane=lane)
        put("running_tasks", section["running"], lane=lane)
        put("workers", len(section["workers"]), lane=lane)
        for label, total in totals.items():
            name, labels = TOTALS[label]
            put(name, total, lane=lane, **labels)
            if label in rates:
                put(RATES[label], rates[label], lane=lane, **labels)

    for lane, section in snapshot["lanes"].items():
        queue_and_volume(lane, section, section["totals"], section["rates"])
        put("held_by_dead_workers", section["held_by_dead"], lane=lane)
        for state in ("done", "failed", "remaining"):
            put("shards", section[f"shards_{state}"], lane=lane, state=state)
        put("samples_done", section["samples_done"], lane=lane)
        put("dead_letters", section["dead_letters"], lane=lane)
        put("eta_seconds", section["eta_s"], lane=lane)
        for reason, turns in section["finish_reasons"].items():
            put("turns_finished_total", turns, lane=lane, reason=reason)
        for counter, count in section["quality"].items():
            words = counter.removeprefix("gate_")
            if words in ("keep", "flag", "drop", "retry"):
                put("quality_gate_decisions_total", count, lane=lane, decision=words)
            else:
                check, _, action = words.rpartition("_")
                put("quality_gate_checks_total", count, lane=lane, check=check, action=action)
        if section["canary_samples"] or section["canary_worst_error"] is not None:
            put("canary_samples_total", section["canary_samples"], lane=lane)
            put("canary_untestable_shards_total", section["canary_untestable"], lane=lane)
            put("canary_window_shards_total", section["canary_window"], lane=lane)
            put("canary_worst_relative_error", section["canary_worst_error"], lane=lane)
    first = next(iter(snapshot["lanes"].values()))
    put("shards_staged", first["shards_total"])
    put("samples_staged", first["samples_total"])
    put("run_eta_seconds", snapshot["eta_s"])
    put("run_finished", snapshot["finished"])
    put("rate_window_seconds", snapshot["window_span_s"])
    put("shards_missing", len(snapshot["shards_missing"]))
    put("storage_listed", snapshot["storage_error"] is None)
    put("stopped_workers", len(snapshot["stopped_workers"]))
    put("workers_waiting_for_servers", len(snapshot["servers_down"]))
    put("servers_down", len({url for waiting in snapshot["servers_down"] for url in waiting["servers"]}))
    audit = snapshot["audit"]
    if audit is not None:
        queue_and_volume("audit", audit, {"samples": audit["samples"], "tokens": audit["tokens"]},
                         {"tokens": audit["tokens_per_s"]})
        put("audited_shards_total", audit["shards"])
        put("audits_failed_total", audit["failed"])
        put("audit_busy_seconds_total", audit["busy_s"])
        put("suspect_shards", len(audit["suspects"]))
        put("suspect_shards_consumed", sum(bool(s["consumed_by"]) for s in audit["suspects"]))
    live = snapshot["live"]
    if live is not None:
        put("epoch", live["epoch"])
        put("window_shards", live["window_fill"])
        put("window_size_shards", live["window_size"])
        put("window_waiting", live["waiting"] is not None)
        for consumer in live["consumers"]:
            put("consumer_lag_shards", consumer["lag"], consumer=consumer["name"])
    put("up", 1)
    return expected


def scraped(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def assert_agree(scrape: dict, snapshot: dict) -> None:
    """Every figure of the scrape is status's, and status's every figure is in the scrape."""
    took = scrape.pop((P + "snapshot_seconds", frozenset({"run": snapshot["run"]}.items())))
    assert took >= 0
    expected = expected_from_status(snapshot)
    assert set(scrape) == set(expected), (sorted(set(scrape) - set(expected)), sorted(set(expected) - set(scrape)))
    span = (P + "rate_window_seconds", frozenset({"run": snapshot["run"]}.items()))
    for key, value in expected.items():
        if key[0] in RATE_METRICS:
            assert scrape[key] * scrape[span] == pytest.approx(value * expected[span], rel=1e-6, abs=1e-6), key
        elif key != span:
            assert scrape[key] == pytest.approx(value, rel=1e-9), key


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        assert response.status == 200
        return response.read().decode()


def status_json(config) -> dict:
    result = dflash_queue("status", "-c", config.source, "--json", "--timeout", "2", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


def agree_now(port: int, config) -> dict:
    """A scrape and `status --json` of a run that is not moving (every worker idle or not started)."""
    text = scrape(port)
    snapshot = status_json(config)
    assert_agree(scraped(text), snapshot)
    return snapshot


def start_exporter(config, port: int, log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "dflash_queue", "metrics", "-c", config.source, "--port", str(port),
             "--cache", "0", "--timeout", "2"],
            stdout=out, stderr=subprocess.STDOUT, env=dict(os.environ),
        )
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, f"metrics exited {process.returncode}:\n{log.read_text()[-3000:]}"
        try:
            scrape(port)
            return process
        except (urllib.error.URLError, ConnectionError):
            if time.monotonic() > deadline:
                raise AssertionError(f"metrics did not listen:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.5)


@pytest.mark.slow
def test_scraped_metrics_agree_with_status_through_a_real_job(make_config, redis_url, start_worker, tmp_path):
    """The exporter as an operator runs it, scraped before the workers start, with the generate lane done and the
    extract lane waiting for its worker, and once the job is done."""
    keep_all = {"on_empty": "flag", "on_repetition": "flag", "on_unclosed_thinking": "flag"}
    config = make_config(
        dataset={"shard_size": 8, "thinking": "never"}, quality=keep_all, **{"generate.sampling": {"max_tokens": 8}}
    )
    configure_app(config)
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(SAMPLE.read_text().splitlines()[:12]) + "\n")  # shards of 8 and 4
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset])
    port = free_port()
    exporter = start_exporter(config, port, tmp_path / "metrics.log")
    try:
        queued = agree_now(port, config)
        assert queued["lanes"]["generate"]["queued"] == 2 and queued["eta_s"] is None
        text = scrape(port)
        assert f'{P}queue_depth{{lane="generate",run="{config.run.name}"}} 2.0' in text
        assert f"{P}run_eta_seconds{{" not in text  # unknown: no sample rather than a made-up figure

        generate = start_worker(config, "generate")
        wait_for_states(ledger, report.shard_ids, {GENERATED}, timeout=300, workers=[generate])
        halfway = agree_now(port, config)
        gen, ext = halfway["lanes"]["generate"], halfway["lanes"]["extract"]
        assert (gen["shards_remaining"], gen["eta_s"], ext["queued"], ext["eta_s"]) == (0, 0.0, 2, None)
        assert gen["totals"]["generated_tokens"] > 0 and gen["workers"] == [generate.hostname]

        extract = start_worker(config, "extract")
        wait_for_states(ledger, report.shard_ids, {DONE}, timeout=300, workers=[generate, extract])
        done = agree_now(port, config)
        assert done["finished"] and done["lanes"]["extract"]["totals"]["samples"] == 12
        assert done["lanes"]["extract"]["canary_samples"] > 0
        assert "dflash_queue_flower" not in scrape(port) and "process_cpu" not in scrape(port)
    finally:
        exporter.terminate()
        exporter.wait(timeout=30)
    assert exporter.returncode == 0


NOW = 1_800_000_000.0


def test_every_figure_of_a_busy_run_agrees_with_status(make_config, redis_url):
    """A run whose ledger and records, written through their own APIs, hold what a real job rarely shows at once:
    dead letters, gate decisions, a canary, stranded servers, a stopped worker, the audit and its suspects, a
    live window."""
    config = make_config(extract={"max_unconsumed_shards": 2}, audit={"enabled": True})
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    ledger = Ledger(client, config.run.name)
    storage = open_storage(config.storage.url)
    shards = [f"s{i}" for i in range(6)]
    for index, shard in enumerate(shards):
        ledger.set_state(shard, DONE if index < 3 else "queued", num_samples=8)
        if index < 3:
            storage.write_bytes(shard_key(shard), b"stored")
    ledger.add({"generate_shards": 3, "generate_samples": 24, "gate_keep": 20, "gate_drop": 4,
                "gate_stub_drop": 3, "gate_unclosed_thinking_flag": 1, "finish_stop": 22, "finish_length": 2,
                "generate_prompt_tokens": 900, "generate_completion_tokens": 2100, "extract_shards": 3,
                "extract_samples": 20, "extract_tokens": 3000, "extract_bytes": 4_000_000,
                "extract_canary_samples": 3, "audit_shards": 2, "audit_samples": 2, "audit_tokens": 700,
                "audit_failed": 1, "audit_busy_ms": 4500}, now=NOW - 120)
    ledger.record_max(CANARY_ERROR, 2.5e-7)
    dead = DeadLetters(client, config.run.name)
    dead.add(DeadLetter(record_id(TASK, "extract", "s5"), TASK, "extract", "dfq.extract", "s5"))
    ServerWaits(client, config.run.name).note("gpu-less-1:42", NOW - 30, {"http://a:8000": "refused",
                                                                          "http://b:8000": "refused"}, ttl_s=600)
    StoppedWorkers(client, config.run.name).record(StoppedWorker("extract-0@n", "extract", "vllm", "checks", time=NOW))
    audits = AuditRecords(client, config.run.name)
    for shard in shards[:3]:
        audits.record_stored(shard, 0, "inc-a", "extract@n", every_shards=100, every_s=0.0, now=NOW - 100)
    audits.note_consumed(audits.record_failed(audits.stored_shard("s1", 0), "layer 2", now=NOW - 5)[0], ["drafter"])
    window = ShardWindow(client, config.run.name)
    window.seal_epoch(0, {shard: 8 for shard in shards})
    window.register("drafter", world_size=1, seed=0)
    window.acknowledge("drafter", 0, "s0")
    client.rpush("audit", "m1")
    client.rpush("generate", "m2", "m3")  # two waiting, one delivered and not acknowledged
    client.hset("unacked", "tag-1", json.dumps([{}, "generate", "generate"]))

    workers = WorkerView(queues={"generate@x": ["generate"], "audit@y": ["audit"]}, running={"generate@x": 1})
    collector = StatusCollector(config.run.name, lambda: collect_status(config, workers=workers, now=NOW))
    server, thread = serve_metrics(collector, address="127.0.0.1", port=(port := free_port()))
    try:
        text = scrape(port)
    finally:
        server.shutdown()
        thread.join(timeout=10)
    snapshot = json.loads(json.dumps(collect_status(config, workers=workers, now=NOW).to_json()))
    figures = scraped(text)
    assert_agree(figures, snapshot)
    run = config.run.name
    # The snapshot held what this test wrote: each kind of figure is compared above, none vacuously.
    assert figures[(P + "queue_depth", frozenset({"run": run, "lane": "generate"}.items()))] == 2
    assert figures[(P + "unacked_messages", frozenset({"run": run, "lane": "generate"}.items()))] == 1
    assert figures[(P + "dead_letters", frozenset({"run": run, "lane": "extract"}.items()))] == 1
    assert figures[(P + "servers_down", frozenset({"run": run}.items()))] == 2
    assert figures[(P + "canary_worst_relative_error", frozenset({"run": run, "lane": "extract"}.items()))] == 2.5e-7
    assert figures[(P + "suspect_shards_consumed", frozenset({"run": run}.items()))] == 1
    assert figures[(P + "window_size_shards", frozenset({"run": run}.items()))] == 2
    assert figures[(P + "consumer_lag_shards", frozenset({"run": run, "consumer": "drafter"}.items()))] == 2
    assert figures[(P + "quality_gate_checks_total",
                    frozenset({"run": run, "lane": "generate", "check": "unclosed_thinking", "action": "flag"}
                              .items()))] == 1
    assert figures[(P + "tokens_per_second", frozenset({"run": run, "lane": "audit", "kind": "sequence"}.items()))] \
        == pytest.approx(700 / snapshot["window_span_s"])


def test_snapshots_are_cached_and_a_broker_that_fails_says_up_0(make_config):
    config = make_config()
    taken: list[float] = []
    clock = [0.0]
    healthy = [True]

    def snapshot():
        if not healthy[0]:
            raise redis.ConnectionError("Connection refused")
        taken.append(clock[0])
        return collect_status(config, workers=WorkerView(), now=NOW)

    collector = StatusCollector(config.run.name, snapshot, cache_s=5.0, clock=lambda: clock[0])
    up = (P + "up", frozenset({"run": config.run.name}.items()))

    def figures():
        return {(s.name, frozenset(s.labels.items())): s.value for f in collector.collect() for s in f.samples}

    assert figures()[up] == 1
    clock[0] = 4.9
    figures()
    assert taken == [0.0]  # within cache_s: the same snapshot
    clock[0] = 5.0
    figures()
    assert taken == [0.0, 5.0]
    healthy[0] = False
    clock[0] = 11.0
    failed = figures()
    assert failed[up] == 0 and not any(name.startswith(P + "queue_depth") for name, _ in failed)
    healthy[0] = True
    clock[0] = 11.1  # a failed snapshot is not kept: the next scrape asks again
    assert figures()[up] == 1 and taken == [0.0, 5.0, 11.1]


def test_the_grafana_dashboard_names_only_exported_metrics(make_config, redis_url):
    """Every expression of the sample dashboard reads a metric the exporter declares."""
    import re

    config = make_config(extract={"max_unconsumed_shards": 2}, audit={"enabled": True})
    ledger = Ledger.from_url(redis_url, config.run.name)
    ledger.set_state("s0", "queued", num_samples=4)
    ledger.add({"extract_canary_samples": 1, "finish_stop": 1, "gate_keep": 1, "gate_stub_drop": 1}, now=NOW)
    ShardWindow(ledger.client, config.run.name).register("drafter", world_size=1, seed=0)
    families = status_families(collect_status(config, workers=WorkerView(), now=NOW))
    declared = {P + "up", P + "snapshot_seconds"}
    for family in families:
        declared.add(family.name + ("_total" if family.type == "counter" else ""))
    dashboard = json.loads(DASHBOARD.read_text())
    expressions = [
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", []) if "expr" in target
    ]
    expressions += [v["query"]["query"] if isinstance(v["query"], dict) else v["query"]
                    for v in dashboard["templating"]["list"] if v.get("type") == "query"]
    assert len(expressions) >= 10
    named = {name for expr in expressions for name in re.findall(r"\bdflash_queue_[a-z_]+", expr)}
    assert named and named <= declared, sorted(named - declared)
    assert {P + "queue_depth", P + "run_eta_seconds", P + "tokens_total", P + "dead_letters"} <= named
