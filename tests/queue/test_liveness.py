"""Liveness by worker process (incarnation), not by node name: a restarted worker's records are its own, and its
dead predecessor's are seen dead as soon as its process is gone. Real redis; the worker processes are stand-ins
(see tests/queue/test_heartbeat.py for real workers killed and restarted)."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

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
    assert liveness.predecessors(successor) == [predecessor]
    assert liveness.held_by([successor]) == []

    liveness.leave(predecessor.id)
    assert liveness.held() == [] and list(liveness.incarnations()) == [successor.id]


def test_a_running_namesake_is_no_predecessor_and_one_elsewhere_is_dead_when_its_heartbeat_stops(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    liveness = Liveness(client, "run", ttl_s=30)
    running = Incarnation.of_this_process("generate-0@box")
    elsewhere = replace(Incarnation.of_this_process("generate-1@box"),
                        process=replace(running.process, host="another-host"))
    liveness.register(running)
    liveness.register(elsewhere)
    liveness.took(elsewhere.id, "task-2", "tag-2", "generate", "shard-2")
    assert liveness.predecessors(Incarnation.of_this_process("generate-0@box")) == []
    # Another host: only the heartbeat tells; a same-named successor does not wait for it.
    assert liveness.held_by_dead() == []
    assert liveness.predecessors(Incarnation.of_this_process("generate-1@box")) == [elsewhere]
    client.delete(f"dfq:run:alive:{elsewhere.id}")
    assert [m.task_id for m in liveness.held_by_dead()] == ["task-2"]
    assert liveness.any_alive()
