"""A broker behind Redis Sentinel losing its primary mid-job, on real parts: a primary, a replica and three
sentinels on loopback, `dflash-queue worker` processes, the tiny model. Replication is asynchronous: what the
primary took in its last moments may never reach the replica. Here the replica is cut off from the primary first,
so the loss is certain: the last shards' task messages and ledger records vanish with the primary, and
`dflash-queue enqueue --rebuild` brings them back; `verify` finds nothing missing and nothing doubled."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from dflash_queue.doctor.broker import check_broker
from dflash_queue.lanes.registry import FIRST_LANE
from dflash_queue.producer import Producer
from dflash_queue.runstate.ledger import DONE, Ledger
from dflash_queue.shards.keys import stored_shard_ids
from dflash_queue.storage import open_storage
from dfq_testing.commands import dflash_queue
from dfq_testing.jobs import connect, drop_pooled_connections, first_lines
from dfq_testing.polling import wait_until
from dfq_testing.sentinel import MASTER_NAME, SentinelGroup

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
pytestmark = pytest.mark.slow


def cut_off_replica(group: SentinelGroup, primary: int) -> None:
    """Stop the replica taking the primary's writes, as a network partition would: it cannot log in again once
    its link is broken. From here on, whatever the primary takes is lost when it dies."""
    replica = redis.Redis(port=next(p for p in group.data_ports if p != primary))
    replica.config_set("masterauth", "not-the-primary's-password")
    redis.Redis(port=primary).client_kill_filter(_type="replica")
    wait_until(lambda: replica.info("replication")["master_link_status"] == "down", 10, "the replica cut off")


def checks_by_name(url: str) -> dict[str, str]:
    return {check.name: f"{check.verdict}: {check.detail}" for check in check_broker(url, timeout_s=2)}


@pytest.fixture
def app_left_unbound():
    """The app's pools hold connections through the sentinels, gone after this test: the next test in this process
    connects afresh."""
    yield
    from dflash_queue.queue.app import app

    drop_pooled_connections(app)


def test_a_job_survives_its_primary_being_killed(sentinel_group, make_config, start_worker, tmp_path,
                                                  app_left_unbound):
    config = make_config(
        broker={"url": sentinel_group.url, "sentinel_master": MASTER_NAME},
        dataset={"shard_size": 4, "thinking": "never"},
        generate__sampling={"max_tokens": 16},
    )
    url = config.broker.connection_url()
    doctor = checks_by_name(url)
    assert doctor["broker reachable"].startswith("pass") and f"master '{MASTER_NAME}'" in doctor["broker reachable"]
    assert doctor["broker sentinels"] == f"pass: 3 of 3 sentinels know master '{MASTER_NAME}'; the primary has 1 " \
                                         "connected replica(s)"

    connect(config)  # the app's pools may hold connections to an earlier test's broker
    workers = [start_worker(config, "generate"), start_worker(config, "extract")]
    ledger = Ledger.from_url(url, config.run.name)
    lines = first_lines(SAMPLE, 20, tmp_path / "all.jsonl").read_text().splitlines(keepends=True)
    first, last = tmp_path / "first.jsonl", tmp_path / "last.jsonl"
    first.write_text("".join(lines[:12]))  # 3 shards of 4
    last.write_text("".join(lines[12:]))  # 2 more
    first_shards = Producer(config, ledger).enqueue([first]).shard_ids
    wait_until(lambda: DONE in ledger.states(first_shards).values(), 300, "a first shard done", workers)

    primary = sentinel_group.primary_port()
    cut_off_replica(sentinel_group, primary)
    last_shards = Producer(config, ledger).enqueue([last]).shard_ids
    assert len(last_shards) == 2 and set(ledger.states(last_shards).values()) == {"queued"}
    sentinel_group.kill(primary)
    promoted = sentinel_group.wait_for_failover(primary)

    # The promoted replica never saw the last shards: their ledger records and task messages are gone.
    assert ledger.states(last_shards) == {}
    queued = redis.Redis(port=promoted).lrange(FIRST_LANE.queue, 0, -1)
    assert not any(shard_id.encode() in message for message in queued for shard_id in last_shards)
    doctor = checks_by_name(url)
    assert doctor["broker sentinels"].startswith("warn") and "no replica to promote" in doctor["broker sentinels"]

    # The workers follow the failover on their own; what has no message left is what verify names, with the
    # command that sends it again.
    storage = open_storage(config.storage.url)
    lost = [shard_id for shard_id in last_shards if shard_id not in stored_shard_ids(storage)]
    before = dflash_queue("verify", first, last, "-c", config.source, timeout=300)
    assert before.returncode != 0, before.stdout
    assert "no message for it in the broker: `dflash-queue enqueue --rebuild` sends it again" in before.stdout, (
        before.stdout + before.stderr[-3000:])
    assert lost, "both last shards were done before the primary died: nothing was lost"

    rebuilt = dflash_queue("enqueue", first, last, "-c", config.source, "--rebuild", timeout=300)
    assert rebuilt.returncode == 0, rebuilt.stdout + rebuilt.stderr[-3000:]
    everything = set(first_shards) | set(last_shards)
    wait_until(lambda: everything <= stored_shard_ids(storage), 300, "every shard stored", workers)
    # The lost shards went through the promoted primary: their messages existed nowhere else.
    wait_until(lambda: set(ledger.states(lost).values()) == {DONE}, 60, "the lost shards done", workers)

    verified = dflash_queue("verify", first, last, "-c", config.source, timeout=300)
    assert verified.returncode == 0, verified.stdout + verified.stderr[-3000:]
    assert "missing: 0" in verified.stdout and "duplicated: 0" in verified.stdout
