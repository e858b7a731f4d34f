"""A worker killed with SIGKILL: the messages it held come back when its heartbeat stops, long before the
visibility timeout; `status` shows them held by a dead worker meanwhile. Real redis, real workers."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from dflash_queue.faults import ENV
from dflash_queue.ops.status import WorkerView, collect_status
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.queue.launcher import WorkerProcess
from dflash_queue.queue.liveness import Liveness
from dflash_queue.runstate.ledger import DONE, GENERATED, Ledger
from dflash_queue.verify import verify
from dfq_testing.jobs import first_lines
from dfq_testing.polling import wait_for_states, wait_until
from tests.faults.test_kill import delivery_counts, wait_for_unacked

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow
LIVENESS_S = 6


def test_a_killed_workers_messages_come_back_after_its_heartbeat_not_the_visibility_timeout(
    make_config, redis_url, start_worker, tmp_path
):
    config = make_config(
        broker={"visibility_timeout_s": 3600, "task_timeout_s": 600, "worker_liveness_s": LIVENESS_S},
        dataset={"shard_size": 4, "thinking": "never"},
        **{"generate.sampling": {"max_tokens": 8}},
    )
    configure_app(config)
    dataset = first_lines(SAMPLE, 8, tmp_path / "prompts.jsonl")
    ledger = Ledger.from_url(redis_url, config.run.name)
    doomed = start_worker(config, "generate", env={ENV: json.dumps({"task_delay_s": 30})})
    report = Producer(config, ledger).enqueue([dataset])
    wait_for_unacked(redis_url, "generate")
    # Killed once its task has begun (its delivery counted), not while the message waits in the worker's prefetch.
    wait_until(lambda: delivery_counts(redis_url, config.run.name) == [1], 60, "the doomed worker's task started")
    doomed.kill()
    killed_at = time.monotonic()

    def held_by_dead():
        lane = collect_status(config, workers=WorkerView()).lanes["generate"]
        return lane if lane.held_by_dead else None

    lane = wait_until(held_by_dead, 3 * LIVENESS_S, "the killed worker's message shown held by a dead worker")
    assert lane.held_by_dead == 1 and lane.reserved == 1
    # No worker is alive to put it back: nothing says when it moves again.
    assert lane.held_back_in_s is None and lane.eta_s is None

    # verify says why each sample is missing and what brings it back.
    accounted = verify(config, [dataset])
    reasons = sorted(set(accounted.missing.values()))
    assert len(accounted.missing) == 8 and len(reasons) == 2, reasons
    assert any(f"held by {doomed.hostname}, a worker whose heartbeat stopped" in r for r in reasons), reasons
    assert any("waiting in the generate queue" in r for r in reasons), reasons

    survivor = start_worker(config, "generate")
    wait_for_states(ledger, report.shard_ids, {GENERATED, DONE}, timeout=120, workers=[survivor])
    assert time.monotonic() - killed_at < 90  # the visibility timeout is an hour
    assert 2 in delivery_counts(redis_url, config.run.name)  # the killed delivery counted
    assert collect_status(config, workers=WorkerView()).lanes["generate"].held_by_dead == 0


def holding(liveness: Liveness, node: str, count: int, redis_url: str, run: str):
    """The tasks `node` holds once it holds `count`, each started (its delivery counted); else None."""
    held = [m for m in liveness.held() if m.node == node]
    started = Ledger.from_url(redis_url, run).deliveries()
    if len(held) == count and all(started.get((m.task_id, 0)) == 1 for m in held):
        return held
    return None


def put_back(ledger: Ledger, held, since: float) -> bool:
    """Every one of these messages back on its queue, or delivered again after `since` (wall clock): out of kombu's
    unacked hash, or in it with a later delivery time (a message keeps its tag when it is put back)."""
    for message in held:
        delivered_at = ledger.client.zscore("unacked_index", message.tag)
        if ledger.client.hexists("unacked", message.tag) and (delivered_at is None or delivered_at < since):
            return False
    return True


def redelivered(ledger: Ledger, held) -> bool:
    counts = ledger.deliveries()
    return all(counts.get((m.task_id, 0), 0) >= 2 for m in held)


def kill_an_extract_worker_holding_three(make_config, redis_url, start_worker, tmp_path):
    """An extract worker (3 task slots) holding three started tasks, SIGKILLed; the default liveness (30 s) and an
    hour's visibility timeout, as deployed. Returns the config, the ledger, the shard ids, the killed worker, its
    tasks, and when it was killed (monotonic and wall clock)."""
    config = make_config(
        broker={"visibility_timeout_s": 3600, "task_timeout_s": 600},
        dataset={"shard_size": 2, "thinking": "never"},
        **{"generate.sampling": {"max_tokens": 8}},
    )
    assert config.broker.worker_liveness_s == 30 and config.storage.uploader.max_pending == 2
    configure_app(config)
    dataset = first_lines(SAMPLE, 12, tmp_path / "prompts.jsonl")
    ledger = Ledger.from_url(redis_url, config.run.name)
    liveness = Liveness(ledger.client, config.run.name, config.broker.worker_liveness_s)
    generate = start_worker(config, "generate")
    doomed = start_worker(config, "extract", env={ENV: json.dumps({"task_delay_s": 600})}, hostname="extract-0@box")
    report = Producer(config, ledger).enqueue([dataset])
    held = wait_until(lambda: holding(liveness, doomed.hostname, 3, redis_url, config.run.name), 120,
                      "the extract worker holding three started tasks", [generate, doomed])
    # No other worker is left to put them back (a live one on this host would, at its next beat).
    wait_for_states(ledger, report.shard_ids, {GENERATED, DONE}, timeout=120, workers=[generate])
    generate.stop()
    doomed.kill()
    return config, ledger, report.shard_ids, doomed, held, time.monotonic(), time.time()


def test_a_worker_restarted_at_once_under_its_name_puts_back_what_its_predecessor_held(
    make_config, redis_url, start_worker, tmp_path
):
    config, ledger, shard_ids, doomed, held, killed_at, killed_wall = kill_an_extract_worker_holding_three(
        make_config, redis_url, start_worker, tmp_path
    )
    successor = start_worker(config, "extract", hostname=doomed.hostname, wait=False)
    wait_until(lambda: put_back(ledger, held, killed_wall), 60, "the predecessor's tasks back on the queue", [successor])
    assert time.monotonic() - killed_at < 60
    assert "succeeding extract-0@box" in successor.log_tail(20000)
    (said,) = [line for line in successor.log_tail(20000).splitlines() if "of its predecessor(s)" in line]
    assert "INFO/" in said and "put back 3 task(s) of its predecessor(s) under node name extract-0@box (1 earlier " \
        "worker(s) gone)" in said, said
    wait_until(lambda: redelivered(ledger, held), 120, "the predecessor's tasks delivered again", [successor])
    wait_for_states(ledger, shard_ids, {DONE}, timeout=180, workers=[successor])
    assert Liveness(ledger.client, config.run.name, 30).held() == []
    assert verify(config, [tmp_path / "prompts.jsonl"]).ok


def test_a_worker_restarted_after_the_units_restart_delay_puts_back_what_its_predecessor_held(
    make_config, redis_url, start_worker, tmp_path
):
    """systemd restarts a failed worker after RestartSec (ops/units: RESTART_S), the same as the default liveness:
    whether the predecessor's heartbeat has expired by then or not, its successor puts its tasks back."""
    from dflash_queue.ops.status_view import status_table
    from dflash_queue.ops.systemd import RESTART_S

    config, ledger, shard_ids, doomed, held, killed_at, killed_wall = kill_an_extract_worker_holding_three(
        make_config, redis_url, start_worker, tmp_path
    )
    assert RESTART_S == config.broker.worker_liveness_s
    # Meanwhile the held work is stranded, never shown moving: no live worker is there to put it back.
    lane = wait_until(lambda: (s := collect_status(config, workers=WorkerView()).lanes["extract"]).held_by_dead and s,
                      RESTART_S / 2, "the dead worker's tasks shown stranded")
    assert lane.held_by_dead == 3 and lane.held_back_in_s is None and lane.eta_s is None
    from rich.console import Console

    console = Console(width=300, record=True)
    console.print(status_table(collect_status(config, workers=WorkerView())))
    assert "3 stranded, held by a dead worker (back once a worker starts)" in console.export_text()
    time.sleep(max(0.0, killed_at + RESTART_S - time.monotonic()))

    successor = start_worker(config, "extract", hostname=doomed.hostname, wait=False)
    wait_until(lambda: put_back(ledger, held, killed_wall), 60, "the predecessor's tasks back on the queue", [successor])
    assert time.monotonic() - killed_at < 60
    wait_until(lambda: redelivered(ledger, held), 120, "the predecessor's tasks delivered again", [successor])
    wait_for_states(ledger, shard_ids, {DONE}, timeout=180, workers=[successor])
    assert collect_status(config, workers=WorkerView()).lanes["extract"].held_by_dead == 0


def test_a_live_namesake_in_another_pid_namespace_keeps_its_tasks_and_a_worker_starting_under_its_name_is_refused(
    make_config, redis_url, start_worker, fork_server, tmp_path
):
    """Two workers under one node name, as in two containers of one host with host networking: the first runs in a
    pid namespace of its own (a real one), so the second cannot see its process, only its fresh heartbeat."""
    from dfq_testing.other_pid_namespace import unshare_available

    why_not = unshare_available()
    if why_not:
        pytest.skip(why_not)
    config = make_config(
        broker={"visibility_timeout_s": 3600, "task_timeout_s": 600, "worker_liveness_s": LIVENESS_S},
        dataset={"shard_size": 4, "thinking": "never"},
        **{"generate.sampling": {"max_tokens": 8}},
    )
    app = configure_app(config)
    dataset = first_lines(SAMPLE, 4, tmp_path / "prompts.jsonl")
    ledger = Ledger.from_url(redis_url, config.run.name)
    liveness = Liveness(ledger.client, config.run.name, LIVENESS_S)
    node = "generate-0@shared-host"
    contained = WorkerProcess(
        "generate", Path(config.source), {**os.environ, ENV: json.dumps({"task_delay_s": 600})},
        tmp_path / "logs" / "contained.log", hostname=node, module="dfq_testing.other_pid_namespace",
        popen=fork_server.popen,
    )
    try:
        contained.wait_ready(app, timeout=180)
        report = Producer(config, ledger).enqueue([dataset])
        held = wait_until(lambda: holding(liveness, node, 1, redis_url, config.run.name), 120,
                          "the contained worker holding its started task", [contained])
        [namesake] = [i for i in liveness.incarnations().values() if i.node == node]
        assert namesake.process.pid == 1 and "another pid namespace" in namesake.process.out_of_sight()

        since = time.time()
        second = start_worker(config, "generate", hostname=node, wait=False)
        wait_until(lambda: not second.alive() or put_back(ledger, held, since), 120,
                   "the second worker refused (or the first one's task put back)", [contained])
        assert not put_back(ledger, held, since), "the live namesake's task was put back"
        assert second.process.wait(timeout=60) == 1
        refusal = second.log_tail()
        assert f"node name {node} is in use by a live worker" in refusal, refusal
        assert f"incarnation {namesake.id[:8]}" in refusal and "another pid namespace" in refusal, refusal
        assert delivery_counts(redis_url, config.run.name) == [1] and contained.alive()
        assert [m.task_id for m in liveness.held()] == [m.task_id for m in held]

        # Killed, its heartbeat expires: then a worker under its name succeeds it, as any dead predecessor.
        contained.kill()
        wait_until(lambda: not liveness.heartbeat_fresh(namesake.id), 3 * LIVENESS_S,
                   "the contained worker's heartbeat expired")
        successor = start_worker(config, "generate", hostname=node, wait=False)
        wait_for_states(ledger, report.shard_ids, {GENERATED, DONE}, timeout=120, workers=[successor])
        assert f"succeeding {node} (pid 1 on " in successor.log_tail(20000)
        assert delivery_counts(redis_url, config.run.name) == [2] and liveness.held() == []
    finally:
        contained.stop(timeout=30)
