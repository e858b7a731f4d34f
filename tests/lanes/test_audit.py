"""The audit lane (lanes/audit.py) on shards the real lanes stored: every entry kind (last layer before and after the
final norm), float32, bfloat16 and fp8 shards, all agree with the checkpoint's own forward; a shard whose stored
states were altered after the fact fails its audit, halts the worker that stored it, and makes suspect what that
worker stored since its last passed audit, marked in storage beside each shard with who had consumed it."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import redis
from safetensors import safe_open
from safetensors.torch import save_file

from dflash_queue.lanes.audit import AuditLane, audit_lane_settings, audited_rows
from dflash_queue.runstate.audits import AuditRecords
from dflash_queue.runstate.window import ShardWindow
from dflash_queue.shards.keys import shard_key, stored_shard_ids, suspect_shard_ids
from dflash_queue.shards.ranges import open_source
from dflash_queue.shards.reader import ShardIndex
from dflash_queue.shards.suspects import read_mark
from dflash_queue.storage import LocalStorage


def copied(config, tmp_path: Path, redis_url: str, **audit):
    """The config's stored shards copied (they are read-only), pointed at the test's broker, the audit on."""
    root = tmp_path / "storage"
    shutil.copytree(config.storage.url, root)
    return config.with_overrides(storage={"url": str(root)}, broker={"url": redis_url},
                                 audit={"enabled": True, "samples_per_shard": 2, **audit})


def recorded(config, redis_url: str, dtype: str) -> tuple[AuditRecords, list[str]]:
    """Every stored shard recorded as stored by one extract worker process, in order."""
    records = AuditRecords(redis.Redis.from_url(redis_url, decode_responses=True), config.run.name)
    shards = sorted(stored_shard_ids(LocalStorage(config.storage.url)))
    for shard in shards:
        records.record_stored(shard, 0, "inc-a", "extract@a", every_shards=1, every_s=0.0, dtype=dtype)
    return records, shards


@pytest.mark.parametrize(("source", "dtype"), [("peer", "float32"), ("peer", "bfloat16"), ("pipeline", "fp8_e4m3")])
def test_stored_shards_of_every_entry_and_dtype_agree_with_the_checkpoints_forward(
    peer_shards, pipeline_shards, tmp_path, redis_url, source, dtype
):
    config = copied((peer_shards if source == "peer" else pipeline_shards)[dtype], tmp_path, redis_url)
    records, shards = recorded(config, redis_url, "float32")  # the Transformers engine computed in float32
    lane = AuditLane(audit_lane_settings(config))
    for shard in shards:
        summary = lane.run(shard)
        assert summary.passed and not summary.suspects and summary.samples == 2, summary.detail
        assert 0 < summary.excess < 1 and summary.counters()["audit_failed"] == 0
        assert records.stored_shard(shard, 0).verdict == "passed"
        assert lane.already_stored(shard).skipped  # a re-delivered task is not audited again
    index = ShardIndex.load(open_source(LocalStorage(config.storage.url), shard_key(shards[0])))
    if source == "peer":
        assert index.layer_states[-2:] == ("last_layer", "final_norm")
    assert "entries compared with the checkpoint's own forward" in summary.detail


def altered(storage_root: Path, shard: str, entry: int) -> None:
    """Rewrite a stored shard with one entry's states one token off in every sequence (as a fault would have)."""
    path = storage_root / shard_key(shard)
    with safe_open(str(path), framework="pt") as handle:
        tensors = {key: handle.get_tensor(key) for key in handle.keys()}
        metadata = handle.metadata()
    states = tensors["hidden_states"]
    states[1:, entry] = states[:-1, entry].clone()
    save_file(tensors, str(path), metadata=metadata)


def test_an_altered_shard_fails_its_audit_halts_its_worker_and_leaves_its_unchecked_shards_suspect(
    peer_shards, tmp_path, redis_url
):
    config = copied(peer_shards["bfloat16"], tmp_path, redis_url, samples_per_shard=1)
    records, [first, second] = recorded(config, redis_url, "float32")
    root = Path(config.storage.url)
    lane = AuditLane(audit_lane_settings(config))
    assert lane.run(first).passed
    window = ShardWindow(records.client, config.run.name)
    window.register("trainer", world_size=1, seed=0)
    window.acknowledge("trainer", 0, second)  # a trainer took it before the fault was found
    altered(root, second, entry=3)  # the last layer's state (before the final norm), one token off
    summary = lane.run(second)
    assert not summary.passed and summary.suspects == (second,) and summary.counters()["audit_failed"] == 1
    assert summary.detail.startswith(f"audit of shard {second}: sample ")
    assert "layer 5 (last_layer): worst token" in summary.detail and summary.excess > 2
    assert records.halted("inc-a").startswith(f"audit of shard {second}")
    [suspect] = records.suspects()
    assert (suspect.shard, suspect.audited, suspect.consumed_by) == (second, second, ["trainer"])
    assert suspect_shard_ids(lane.storage, 0) == {second}
    mark = read_mark(lane.storage, second, 0)
    assert mark is not None and mark.node == "extract@a" and "last_layer" in mark.reason


def test_the_audited_samples_take_the_longest_in_every_other_shard(pipeline_shards):
    storage = LocalStorage(pipeline_shards["float32"].storage.url)
    index = ShardIndex.load(open_source(storage, shard_key(sorted(stored_shard_ids(storage))[0])))
    lengths = [end - start for start, end in (index.rows(i) for i in range(len(index)))]
    longest = max(range(len(lengths)), key=lambda i: (lengths[i], -i))
    firsts = {f"shard-{n}": audited_rows(index, f"shard-{n}", 1)[0] for n in range(40)}
    with_longest = sum(row == longest for row in firsts.values())
    assert 15 <= with_longest <= 30  # about half of the shards, and the others spread over the shard
    assert len(set(firsts.values())) > 2 and audited_rows(index, "shard-1", 3) == audited_rows(index, "shard-1", 3)
    assert len(set(audited_rows(index, "shard-1", 3))) == 3
