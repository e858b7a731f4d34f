"""Liveness by worker process (incarnation), not by node name: a restarted worker's records are its own, and its
dead predecessor's are seen dead as soon as its process is gone; a namesake out of sight (another host, boot or pid
namespace) is alive while its heartbeat is. Real redis; the worker processes are stand-ins
(see tests/queue/test_heartbeat.py for real workers killed and restarted)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
import redis

from dflash_queue.queue.liveness import Incarnation, Liveness
from dflash_queue.queue.process_identity import ProcessIdentity


def incarnation_of(child: subprocess.Popen, node: str) -> Incarnation:
    with open(f"/proc/{child.pid}/stat") as stat:
        ticks = stat.read().rpartition(")")[2].split()[19]
    process = replace(ProcessIdentity.of_this_process(), pid=child.pid, start_ticks=ticks)
    return replace(Incarnation.of_this_process(node), process=process)


def test_a_successor_under_the_same_name_neither_refreshes_nor_inherits_its_predecessors_records(redis_url):
    liveness = Liveness(redis.Redis.from_url(redis_url, decode_responses=True), "run", ttl_s=30)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        predecessor = incarnation_of(child, "extract-0@box")
        liveness.register(predecessor)
        liveness.took(predecessor.id, "task-1", "tag-1", "extract", "shard-1")
        assert liveness.held_by_dead() == [] and liveness.any_alive()
        child.kill()
        child.wait()
    finally:
        child.kill()
        child.wait()

    successor = Incarnation.of_this_process("extract-0@box")
    liveness.register(successor)
    assert successor.id != predecessor.id
    # The heartbeat is the predecessor's own, still fresh: its process is seen gone all the same.
    assert liveness.heartbeat_fresh(predecessor.id)
    [held] = liveness.held_by_dead()
    assert (held.node, held.incarnation, held.task_id, held.shard_id) == ("extract-0@box", predecessor.id, "task-1",
                                                                         "shard-1")
    assert liveness.predecessors(successor) == [predecessor] and liveness.live_namesakes(successor) == []
    assert liveness.held_by([successor]) == []

    liveness.leave(predecessor.id)
    assert liveness.held() == [] and list(liveness.incarnations()) == [successor.id]


def test_a_namesake_seen_running_is_alive_and_no_predecessor(redis_url):
    liveness = Liveness(redis.Redis.from_url(redis_url, decode_responses=True), "run", ttl_s=30)
    running = Incarnation.of_this_process("generate-0@box")
    liveness.register(running)
    successor = Incarnation.of_this_process("generate-0@box")
    assert liveness.predecessors(successor) == [] and liveness.live_namesakes(successor) == [running]
    assert liveness.live_namesakes(Incarnation.of_this_process("generate-1@box")) == []


@pytest.mark.parametrize("elsewhere", [
    {"host": "another-host"},
    {"boot_id": "another-boot"},
    {"pid_namespace": "pid:[4026530000]"},  # another container's, on this host (host networking: one host name)
], ids=["host", "boot", "pid-namespace"])
def test_a_namesake_out_of_sight_is_alive_while_its_heartbeat_is_and_a_predecessor_once_it_expired(
    redis_url, elsewhere
):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    liveness = Liveness(client, "run", ttl_s=30)
    here = Incarnation.of_this_process("generate-0@box")
    namesake = replace(here, process=replace(here.process, **elsewhere))
    assert namesake.process.running() is None and namesake.process.out_of_sight()
    liveness.register(namesake)
    liveness.took(namesake.id, "task-2", "tag-2", "generate", "shard-2")
    successor = Incarnation.of_this_process("generate-0@box")
    # Its heartbeat fresh: alive, its messages its own; a worker starting under its name is to be refused.
    assert liveness.predecessors(successor) == [] and liveness.held_by_dead() == []
    assert liveness.live_namesakes(successor) == [namesake] and liveness.any_alive()
    client.delete(f"dfq:run:alive:{namesake.id}")
    assert liveness.predecessors(successor) == [namesake] and liveness.live_namesakes(successor) == []
    assert [m.task_id for m in liveness.held_by_dead()] == ["task-2"] and not liveness.any_alive()
