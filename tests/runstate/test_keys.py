"""The run's Redis keys: every string as released (a running job's state must stay readable by the next version),
the components writing exactly those on a real redis-server, and no key spelled out anywhere but runstate/keys.py."""

from __future__ import annotations

import ast
from pathlib import Path

import redis

from dflash_queue.deadletters.records import DeadLetter, DeadLetters
from dflash_queue.queue.liveness import Incarnation, Liveness
from dflash_queue.runstate.audits import AuditRecords
from dflash_queue.runstate.keys import RunKeys
from dflash_queue.runstate.ledger import Ledger
from dflash_queue.runstate.served_weights import ServedWeights
from dflash_queue.runstate.server_waits import ServerWaits
from dflash_queue.runstate.stopped_workers import StoppedWorker, StoppedWorkers
from dflash_queue.runstate.window import ShardWindow

REPO = Path(__file__).resolve().parents[2]
KEYS_MODULE = REPO / "dflash_queue" / "runstate" / "keys.py"

# Every kind of key of run "r", as released. A new kind is added here; an existing string never changes.
RELEASED = {
    "root": "dfq:r",
    "shard_states": "dfq:r:shard_state",
    "shard_samples": "dfq:r:shard_samples",
    "counters": "dfq:r:counters",
    "failures": "dfq:r:failures",
    "rate_prefix": "dfq:r:rate:",
    "rate_bucket": ("dfq:r:rate:472222", 472222),
    "first_add": "dfq:r:first_add",
    "counted": "dfq:r:counted",
    "maxima": "dfq:r:maxima",
    "identity": "dfq:r:identity",
    "served_weights": "dfq:r:served_weights",
    "delivery_prefix": "dfq:r:delivery:",
    "delivery": ("dfq:r:delivery:task-1:2", "task-1", 2),
    "live_prefix": "dfq:r:live:",
    "window": "dfq:r:live:window",
    "consumers": "dfq:r:live:consumers",
    "waiting": "dfq:r:live:waiting",
    "acknowledged": ("dfq:r:live:acked:trainer:3", "trainer", 3),
    "ranks_seen": ("dfq:r:live:seen:trainer", "trainer"),
    "epochs_wanted": "dfq:r:live:epochs_wanted",
    "readers_finished": ("dfq:r:live:finished:trainer", "trainer"),
    "epoch_shards": ("dfq:r:live:epoch:3:shards", 3),
    "epoch_sealed": ("dfq:r:live:epoch:3:sealed", 3),
    "epoch_claimed": ("dfq:r:live:epoch:3:claimed", 3),
    "epoch_stored": ("dfq:r:live:epoch:3:stored", 3),
    "epoch_stored_count": ("dfq:r:live:epoch:3:count", 3),
    "epoch_states": ("dfq:r:live:epoch:3:state", 3),
    "epoch_failures": ("dfq:r:live:epoch:3:failures", 3),
    "incarnations": "dfq:r:incarnations",
    "alive": ("dfq:r:alive:abc", "abc"),
    "held_prefix": "dfq:r:held:",
    "held": ("dfq:r:held:abc", "abc"),
    "last_seen": "dfq:r:last_seen",
    "stopped_workers": "dfq:r:stopped_workers",
    "servers_down_prefix": "dfq:r:servers_down:",
    "servers_down": ("dfq:r:servers_down:host:12", "host:12"),
    "audit_sequence": "dfq:r:audit:seq",
    "audit_worker_prefix": "dfq:r:audit:worker:",
    "audit_worker": ("dfq:r:audit:worker:abc", "abc"),
    "audit_stored": ("dfq:r:audit:stored:abc", "abc"),
    "audit_passed": ("dfq:r:audit:passed:abc", "abc"),
    "audit_shards": "dfq:r:audit:shards",
    "suspects": "dfq:r:suspects",
    "dead_letters": "dfq:r:dead",
}


def test_every_kind_of_key_is_the_string_released():
    keys = RunKeys("r")
    kinds = {name for name in dir(RunKeys) if not name.startswith("_") and name != "run_name"}
    assert kinds == set(RELEASED), "a key kind was added or removed: pin its string in RELEASED"
    for name, released in RELEASED.items():
        if isinstance(released, tuple):
            expected, *args = released
            assert getattr(keys, name)(*args) == expected, name
        else:
            assert getattr(keys, name) == released, name


def test_the_components_write_the_released_keys(redis_url):
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    ledger = Ledger(client, "r")
    ledger.set_state("s1", "queued", num_samples=4)
    ledger.mark_failed("s2", "broken")
    ledger.add_once("token", {"samples": 4}, now=472222 * 60.0)
    ledger.record_max("canary", 0.5)
    ledger.claim_identity("{}")
    ServedWeights(client, "r").claim("{}")
    ledger.count_delivery("task-1", 2)
    window = ShardWindow(client, "r")
    window.seal_epoch(3, {"s1": 4})
    window.claim_epoch(3)
    window.record_stored(3, "s1")
    window.set_epoch_state(3, "s1", "failed", "broken")
    window.register("trainer", world_size=1, seed=0)
    window.seen("trainer", 0, 3)
    window.want_epochs("trainer", 2)
    window.part_finished("trainer", 0, (0, 1))
    window.acknowledge("trainer", 3, "s1")
    window.take_place(3, "s2", 1)  # s1 every consumer acknowledged: it would take no place
    window.note_waiting(3, "s2", 60)
    liveness = Liveness(client, "r", ttl_s=60)
    incarnation = Incarnation.of_this_process("node")
    liveness.register(incarnation)
    liveness.took(incarnation.id, "task-1", "tag", "generate", "s1")
    StoppedWorkers(client, "r").record(StoppedWorker("node", "extract", "vllm", "checks"))
    ServerWaits(client, "r").note("host:12", 1.0, {"http://a": "refused"}, ttl_s=60)
    DeadLetters(client, "r").add(DeadLetter("d1", "task", "generate", "dfq.generate"))
    audits = AuditRecords(client, "r")
    audits.record_stored("s1", 0, "abc", "node", every_shards=1, every_s=0.0)
    audits.record_passed(audits.stored_shard("s1", 0), "ok")
    audits.record_failed(audits.stored_shard("s1", 0), "wrong")

    expected = {
        value[0] if isinstance(value, tuple) else value
        for name, value in RELEASED.items()
        if not name.endswith("_prefix") and name != "root"
    }
    expected = {key.replace(":abc", f":{incarnation.id}") if ":audit:" not in key else key for key in expected}
    assert set(client.keys("dfq:*")) == expected


def _spelled_out_keys(path: Path) -> list[str]:
    """`file:line: text` of every string in the code (docstrings aside) that holds `dfq:`."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
        and node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        f"{path.relative_to(REPO)}:{node.lineno}: {node.value!r}"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and "dfq:" in node.value
        and id(node) not in docstrings
    ]


def test_no_key_is_spelled_out_outside_the_keys_module():
    found = [
        hit
        for folder in ("dflash_queue", "dfq_testing", "tools")
        for path in sorted((REPO / folder).rglob("*.py"))
        if path != KEYS_MODULE
        for hit in _spelled_out_keys(path)
    ]
    assert not found, "build the run's keys with dflash_queue.runstate.keys.RunKeys:\n" + "\n".join(found)
    assert _spelled_out_keys(KEYS_MODULE), "the scan finds no key even where they are built"
