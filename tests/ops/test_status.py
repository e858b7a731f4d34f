"""`dflash-queue status` against a real job: every figure compared with what the job is known to have made."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import redis

from dflash_queue.deadletters import TASK, DeadLetter, DeadLetters, record_id
from dflash_queue.ops.status import (
    WorkerView,
    collect_status,
    queue_depth,
    unacked_by_queue,
)
from dflash_queue.ops.status_view import status_table
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.runstate.ledger import DONE, Ledger
from dflash_queue.shards.completions import decode_completions
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.shards.training import TrainingShard
from dflash_queue.storage import open_storage
from dfq_testing.commands import dflash_queue
from dfq_testing.polling import wait_for_states

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"


def status_json(config) -> dict:
    result = dflash_queue("status", "-c", config.source, "--json", "--timeout", "2", timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout)


@pytest.mark.slow
def test_status_figures_match_a_real_job(make_config, redis_url, start_worker, tmp_path):
    # Every quality check flags rather than drops, so all 20 samples reach the extract lane.
    keep_all = {"on_empty": "flag", "on_repetition": "flag", "on_unclosed_thinking": "flag"}
    config = make_config(
        dataset={"shard_size": 8, "thinking": "never"}, quality=keep_all, **{"generate.sampling": {"max_tokens": 16}}
    )
    configure_app(config)
    dataset = tmp_path / "prompts.jsonl"
    dataset.write_text("\n".join(SAMPLE.read_text().splitlines()[:20]) + "\n")  # 20 samples: shards of 8, 8, 4
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset])
    assert report.enqueued == 3

    before = status_json(config)
    gen, ext = before["lanes"]["generate"], before["lanes"]["extract"]
    assert (gen["queued"], gen["reserved"], gen["running"], gen["workers"]) == (3, 0, None, [])
    assert (ext["queued"], ext["shards_remaining"]) == (0, 3)
    assert (gen["samples_total"], gen["samples_done"], gen["shards_total"], gen["shards_remaining"]) == (20, 0, 3, 3)
    assert gen["eta_s"] is None and before["eta_s"] is None and not before["finished"]

    workers = [start_worker(config, "generate"), start_worker(config, "extract")]
    wait_for_states(ledger, report.shard_ids, {DONE}, timeout=300, workers=workers)

    # What the job made, read back from storage independently of the ledger.
    storage = open_storage(config.storage.url)
    prompt_tokens = completion_tokens = extract_tokens = extract_bytes = 0
    for shard_id in report.shard_ids:
        for record in decode_completions(storage.read_bytes(completions_key(shard_id)), what=shard_id):
            prompt_tokens += len(record.prompt_ids)
            completion_tokens += len(record.completion_ids)
        with storage.local_copy(shard_key(shard_id)) as path:
            extract_tokens += TrainingShard(path).num_tokens
            extract_bytes += path.stat().st_size

    after = status_json(config)
    gen, ext = after["lanes"]["generate"], after["lanes"]["extract"]
    assert gen["totals"] == {"samples": 20, "prompt_tokens": prompt_tokens, "generated_tokens": completion_tokens}
    assert ext["totals"] == {"samples": 20, "tokens": extract_tokens, "bytes": extract_bytes}
    assert extract_tokens == prompt_tokens + completion_tokens
    for lane, worker in (("generate", workers[0]), ("extract", workers[1])):
        s = after["lanes"][lane]
        assert (s["queued"], s["reserved"], s["running"]) == (0, 0, 0)
        assert s["workers"] == [worker.hostname]
        assert (s["shards_done"], s["shards_failed"], s["shards_remaining"], s["samples_done"]) == (3, 0, 0, 20)
        assert s["eta_s"] == 0.0 and s["dead_letters"] == 0
    assert after["finished"] and after["eta_s"] == 0.0
    # The whole job fits in the window: each rate times the span it was measured over is the total.
    span = after["window_span_s"]
    assert 0 < span <= after["window_s"]
    for lane in (gen, ext):
        for label, total in lane["totals"].items():
            assert lane["rates"][label] * span == pytest.approx(total)
    counters = ledger.counters()
    assert counters["generate_busy_ms"] > 0 and counters["extract_busy_ms"] > 0

    # Counters live in Redis: with every worker gone, the figures stay.
    for worker in workers:
        worker.stop()
    stopped = status_json(config)
    assert stopped["lanes"]["generate"]["workers"] == [] and stopped["lanes"]["generate"]["running"] is None
    assert stopped["lanes"]["generate"]["totals"] == gen["totals"]
    assert stopped["lanes"]["extract"]["totals"] == ext["totals"]


def test_eta_quality_dead_letters_and_failures_from_the_ledger(make_config, redis_url):
    """A ledger written through its own API at known times gives a known ETA; dead letters show per lane."""
    config = make_config()
    ledger = Ledger.from_url(redis_url, config.run.name)
    now = 1_800_000_000.0
    for index in range(10):
        ledger.set_state(f"s{index}", DONE if index < 4 else "queued", num_samples=8)
    storage = open_storage(config.storage.url)
    for index in range(3):  # s3 is marked done, but its training file is not in storage
        storage.write_bytes(shard_key(f"s{index}"), b"stored")
    ledger.mark_failed("s9", "dfq.extract: RuntimeError: boom")
    ledger.add({"enqueued_samples": 80}, now=now - 300)
    # In the last 5 minutes: 4 shards generated and extracted, so 1 shard per 75 s per lane.
    ledger.add({"generate_shards": 4, "generate_samples": 32, "gate_keep": 28, "gate_flag": 2,
                "gate_drop": 4, "gate_stub_drop": 3, "gate_truncated_flag": 2, "gate_empty_drop": 1,
                "finish_stop": 37, "finish_length": 5, "generate_prompt_tokens": 1200,
                "generate_completion_tokens": 3400}, now=now - 10)
    ledger.add({"extract_shards": 4, "extract_samples": 26, "extract_tokens": 4600, "extract_bytes": 5_000_000},
               now=now - 5)
    dead = DeadLetters.from_url(redis_url, config.run.name)
    for shard in ("s7", "s8"):
        dead.add(DeadLetter(record_id(TASK, "generate", shard), TASK, "generate", "dfq.generate", shard))

    status = collect_status(config, window_s=600, workers=WorkerView(), now=now)
    gen, ext = status.lanes["generate"], status.lanes["extract"]
    assert status.window_span_s == pytest.approx(300.0)
    assert (gen.shards_done, gen.shards_remaining, gen.shards_failed) == (4, 5, 0)
    assert (ext.shards_done, ext.shards_remaining, ext.shards_failed) == (3, 5, 1)
    assert status.shards_missing == ["s3"] and status.storage_error is None and not status.finished
    assert gen.eta_s == pytest.approx(5 * 75.0) and ext.eta_s == pytest.approx(5 * 75.0)
    assert gen.quality == {"gate_drop": 4, "gate_empty_drop": 1, "gate_flag": 2, "gate_keep": 28,
                           "gate_stub_drop": 3, "gate_truncated_flag": 2}
    assert gen.quality_dropped == 4
    assert gen.finish_reasons == {"length": 5, "stop": 37} and ext.finish_reasons == {}
    assert (gen.dead_letters, ext.dead_letters) == (2, 0)

    text = _render(status)
    assert "6 min" in text
    words = " ".join(text.split())
    assert "28 kept, 2 flagged, 4 dropped, 0 retried; empty: 1 dropped; stub: 3 dropped; truncated: 2 flagged" in words
    assert "gate_" not in text and "_drop" not in text and "_flag" not in text  # the gate's words, not counter names
    assert f"1 shard(s) marked done have no training file in {config.storage.url} (e.g. s3)" in " ".join(text.split())
    assert "truncated 5 · stopped 37" in text
    # Each lane's volume as the registry declares it: the generate column, then the extract column.
    assert re.search(r"tokens +│ prompt 1,200 · generated 3,400 +│ 4,600 · 5.0 MB +│", text)
    assert re.search(r"throughput +│ prompt 4.0 tok/s · generated 11.3 tok/s +│ 15.3 tok/s · 16.7 KB/s +│", text)
    assert "no sample checked yet" in text


def test_work_held_by_a_dead_worker_is_stranded_never_moving(make_config, redis_url):
    """Two generate tasks held by a dead worker (its heartbeat gone): shown stranded, not in flight; the ETA is at
    least their return plus their processing, and unknown while no worker lives to put them back."""
    from dflash_queue.queue.liveness import Incarnation, Liveness

    config = make_config(broker={"worker_liveness_s": 300})
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    ledger = Ledger(client, config.run.name)
    now = 1_800_000_000.0
    for index in range(10):
        ledger.set_state(f"s{index}", DONE if index < 4 else "queued", num_samples=8)
    ledger.add({"enqueued_samples": 80}, now=now - 300)
    ledger.add({"generate_shards": 4}, now=now - 10)  # 1 shard per 75 s: 6 left, 450 s
    liveness = Liveness(client, config.run.name, 300)
    dead = Incarnation.of_this_process("generate-0@gone")
    liveness.register(dead)
    for shard in ("s4", "s5"):
        liveness.took(dead.id, f"task-{shard}", f"tag-{shard}", "generate", shard)
        client.hset("unacked", f"tag-{shard}", json.dumps([{}, "generate", "generate"]))
    client.delete(f"dfq:{config.run.name}:alive:{dead.id}")
    client.hset(f"dfq:{config.run.name}:last_seen", dead.id, repr(now - 10))

    alone = collect_status(config, window_s=600, workers=WorkerView(), now=now).lanes["generate"]
    assert (alone.reserved, alone.held_by_dead) == (2, 2)
    assert alone.held_back_in_s is None and alone.eta_s is None  # nobody alive to put them back
    assert "0 unacked; 2 stranded, held by a dead worker (back once a worker starts)" in _render(
        collect_status(config, window_s=600, workers=WorkerView(), now=now))

    liveness.register(Incarnation.of_this_process("generate-1@here"))  # a live worker puts them back
    status = collect_status(config, window_s=600, workers=WorkerView(), now=now)
    lane = status.lanes["generate"]
    # Back by the dead heartbeat's expiry and one more beat (400 s after it was last seen), then done at the rate.
    assert lane.held_back_in_s == pytest.approx(390.0)
    assert lane.eta_s == pytest.approx(390.0 + 2 * 75.0)
    assert "2 stranded, held by a dead worker (back on the queue in 6 min)" in _render(status)


def test_while_every_server_is_down_there_is_no_countdown_and_the_outage_is_not_in_the_rate(make_config, redis_url):
    """A generate worker waits for its inference servers: each lane with work left shows it waits instead of an ETA,
    the run's ETA is no number, and the throughput is measured up to the outage, not diluted by it."""
    from dflash_queue.runstate.server_waits import ServerWaits

    config = make_config()
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    ledger = Ledger(client, config.run.name)
    now = 1_800_000_000.0
    for index in range(10):
        ledger.set_state(f"s{index}", DONE if index < 4 else "queued", num_samples=8)
    ledger.add({"enqueued_samples": 80}, now=now - 300)
    ledger.add({"generate_shards": 4, "extract_shards": 4}, now=now - 200)
    waits = ServerWaits(client, config.run.name)
    waits.note("host:7", now - 100, {"http://10.0.0.9:30000": "cannot connect"}, ttl_s=600)

    status = collect_status(config, window_s=600, workers=WorkerView(), now=now)
    gen, ext = status.lanes["generate"], status.lanes["extract"]
    assert gen.waiting_for_servers and ext.waiting_for_servers and gen.eta_s is None and status.eta_s is None
    assert status.window_span_s == pytest.approx(200.0)  # up to the outage: 4 shards in 200 s, not in 300 s
    text = " ".join(_render(status).split())
    assert "run ETA: waiting for servers (every inference server down for" in text, text
    assert re.search(r"ETA │ waiting for servers │ waiting for servers │", text), text
    assert "before the inference servers went down" in text
    assert "generate worker host:7 waits: every inference server has been down for 100 s" in text

    waits.clear("host:7")  # the servers are back: a countdown again, at the rate over the whole window
    status = collect_status(config, window_s=600, workers=WorkerView(), now=now)
    assert not status.lanes["generate"].waiting_for_servers and status.window_span_s == pytest.approx(300.0)
    assert status.eta_s == pytest.approx(6 / (4 / 300))


def test_queue_depth_counts_priority_queues_and_unacked_by_lane(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.rpush("generate", "a", "b")
    client.rpush("generate\x06\x169", "c")  # kombu's sub-queue for priority 9
    client.hset("unacked", mapping={
        "t1": json.dumps([{}, "generate", "generate"]),
        "t2": json.dumps([{}, "extract", "extract"]),
        "t3": json.dumps([{}, "extract", "extract"]),
    })
    assert queue_depth(client, "generate") == 3 and queue_depth(client, "extract") == 0
    assert unacked_by_queue(client) == {"generate": 1, "extract": 2}


def _render(status) -> str:
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(status_table(status))
    return console.export_text()


def test_asking_the_workers_leaves_no_connection_a_forked_process_would_hang_on(make_config, redis_url):
    """A process that asked the workers (status in a training script, say) and then forks (a DataLoader's workers):
    the child runs kombu's after-fork cleanup of the app's pooled connections and must not block on one."""
    from dflash_queue.ops.status import ask_workers
    from dflash_queue.queue.app import configure_app
    from dfq_testing.jobs import channels_in_poll, forked_child_exits

    app = configure_app(make_config())
    for _ in range(3):
        assert ask_workers(app, timeout=0.3).queues == {}  # no worker runs: nobody answers
    # What the child's cleanup would block on: a pooled connection whose channel is inside a blocking read; with
    # the replies read on the pool's connections, one was left so.
    assert channels_in_poll(app) == []
    assert forked_child_exits()


def test_a_run_whose_later_epoch_or_consumer_is_pending_is_not_finished(make_config, redis_url):
    """Every shard passed every lane, but a trainer following the run wants a second epoch: not finished while that
    epoch is not extracted, nor while the consumer has not consumed it; finished once it has."""
    from dflash_queue.runstate.window import ShardWindow

    config = make_config()
    ledger = Ledger.from_url(redis_url, config.run.name)
    consumption = ShardWindow(ledger.client, config.run.name)
    storage = open_storage(config.storage.url)
    shards = {"s0": 4, "s1": 4}
    for shard in shards:
        ledger.set_state(shard, DONE, num_samples=4)
        storage.write_bytes(shard_key(shard), b"stored")
    consumption.seal_epoch(0, shards)
    consumption.register("drafter", world_size=1, seed=0)
    consumption.want_epochs("drafter", 2)
    for shard in shards:
        consumption.acknowledge("drafter", 0, shard)
    consumption.seal_epoch(1, shards)  # epoch 1 started, nothing of it extracted yet

    def shown():
        status = collect_status(config, workers=WorkerView())
        return status, " ".join(_render(status).split())

    status, text = shown()
    assert not status.finished and "run finished" not in text, text
    assert "epoch 1: 0 / 2 shards extracted" in text and "training goes on: consumer drafter: epoch 1: 2 of 2" in text
    for shard in shards:
        consumption.set_epoch_state(1, shard, DONE)
    status, text = shown()
    assert not status.finished and "training goes on: consumer drafter: epoch 1: 2 of 2 shards not consumed" in text
    for shard in shards:
        consumption.acknowledge("drafter", 1, shard)
    consumption.part_finished("drafter", 0, (0, 1))
    status, text = shown()
    assert status.finished and "run finished" in text and "training goes on" not in text, text


def test_the_audit_has_a_section_with_its_figures_and_suspect_shards_keep_the_run_unfinished(make_config, redis_url):
    """The audit, a side lane: its queue, workers (from the same broadcast as the other lanes), figures and failed
    audits; the suspect shards with their reasons, and those consumed before they turned suspect with their
    consumers. No section for a run that has no audit and no suspect."""
    from dflash_queue.runstate.audits import AuditRecords

    quiet = make_config("quiet.toml", run={"name": "quiet"})
    ledger = Ledger.from_url(redis_url, quiet.run.name)
    ledger.set_state("q0", DONE, num_samples=4)
    open_storage(quiet.storage.url).write_bytes(shard_key("q0"), b"stored")
    status = collect_status(quiet, workers=WorkerView())
    assert status.audit is None and status.finished and "audit:" not in _render(status)

    config = make_config(audit={"enabled": True})
    ledger = Ledger.from_url(redis_url, config.run.name)
    storage = open_storage(config.storage.url)
    now = 1_800_000_000.0
    shards = [f"s{i}" for i in range(8)]
    for shard in shards:
        ledger.set_state(shard, DONE, num_samples=4)
        storage.write_bytes(shard_key(shard), b"stored")
    ledger.add({"audit_shards": 3, "audit_samples": 3, "audit_tokens": 1200, "audit_failed": 1,
                "audit_busy_ms": 9000}, now=now - 10)
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.rpush("audit", "m1", "m2")
    audits = AuditRecords(client, config.run.name)
    for shard in shards:
        audits.record_stored(shard, 0, "inc-a", "extract@node-a", every_shards=100, every_s=0.0, now=now - 100)
    audits.record_passed(audits.stored_shard("s0", 0), "ok")
    made = audits.record_failed(audits.stored_shard("s1", 0), "layer 2: worst token 1.3e+00", now=now - 5)
    assert [s.shard for s in made] == shards[1:]  # what inc-a stored after its passed audit of s0
    audits.note_consumed(made[0], ["drafter", "eval"])
    workers = WorkerView(queues={"audit@x": ["audit"], "extract@y": ["extract"]}, running={"audit@x": 1})

    status = collect_status(config, window_s=600, workers=workers, now=now)
    audit = status.audit
    assert audit is not None and not status.finished
    assert (audit.queued, audit.running, audit.workers) == (2, 1, ["audit@x"])
    assert (audit.shards, audit.samples, audit.tokens, audit.failed, audit.busy_s) == (3, 3, 1200, 1, 9.0)
    assert status.window_span_s == pytest.approx(10.0) and audit.tokens_per_s == pytest.approx(1200 / 10.0)
    assert [s.shard for s in audit.suspects] == shards[1:] and audit.consumed_suspects[0].consumed_by == (
        "drafter", "eval")
    assert "audit" not in status.lanes  # a side lane: no column, no progress, no ETA
    snapshot = json.loads(json.dumps(status.to_json()))["audit"]  # as `status --json` prints it
    assert snapshot["suspects"][0]["consumed_by"] == ["drafter", "eval"] and snapshot["failed"] == 1

    text = " ".join(_render(status).split())
    assert "audit: workers 1 (audit@x) · queue 2 · in flight 1 running, 0 unacked · 3 shards audited, 3 samples, " \
        "1,200 tokens (120 tok/s) · 1 failed" in text, text
    assert "suspect shards: 7, not served as good until extracted again (`dflash-queue suspects reextract`): " \
        "s1: layer 2: worst token 1.3e+00; s2: layer 2" in text and "; and 2 more (`dflash-queue suspects list`)" in text
    assert "consumed before they turned suspect: 1 shard(s): s1 by drafter, eval" in text
    assert "every shard has passed every lane; 7 suspect shard(s) wait to be extracted again" in text
