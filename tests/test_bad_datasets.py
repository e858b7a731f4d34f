"""Datasets that give nothing to stage, or too many bad records (dataset.max_bad_share), are refused with the files,
the counts, the first problems and the setting, before anything is enqueued; a fine dataset whose every shard is
done already is not."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import redis

from dflash_queue.errors import DatasetRefused
from dflash_queue.lanes.registry import GENERATE
from dflash_queue.producer import PROBE_RECORDS, Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.runstate.ledger import DONE, Ledger
from dflash_queue.shards.keys import PROMPTS, SHARDS, shard_key
from dflash_queue.storage import open_storage
from dfq_testing.commands import dflash_queue

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
GARBAGE = ["{broken", '{"conversations": []}', '{"text": "no known schema"}']


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n")
    return path


def good_lines(count: int) -> list[str]:
    return [json.dumps({"conversations": [{"from": "human", "value": f"question number {i}"}]}) for i in range(count)]


def messages_waiting(url: str) -> int:
    return redis.Redis.from_url(url).llen(GENERATE.queue)


def test_run_on_a_garbage_only_dataset_exits_1_naming_the_file_line_and_key(make_config, tmp_path):
    config = make_config(broker={"url": ""})
    garbage = write_lines(tmp_path / "garbage.jsonl", GARBAGE)
    ran = dflash_queue("run", garbage, "-c", config.source, timeout=300)
    assert ran.returncode == 1, ran.stdout + ran.stderr
    error = " ".join(ran.stderr.split())
    assert f"{garbage}: nothing to stage: 0 usable samples of 3 record(s) (3 bad" in error, ran.stderr
    assert f"{garbage}:1: malformed JSON" in error and f"{garbage}:2 [conversations]: empty conversation" in error
    assert "Nothing was enqueued." in error
    assert "training shards:" not in ran.stdout  # no summary pointing at output that was never made
    storage = Path(config.storage.url)
    assert not (storage / SHARDS).exists() and not (storage / PROMPTS).exists()


def test_a_file_over_the_bad_share_is_refused_with_nothing_enqueued_and_passes_once_the_share_is_raised(
    make_config, redis_url, tmp_path
):
    mixed = write_lines(tmp_path / "mixed.jsonl", [*GARBAGE, *good_lines(2)])  # 3 of 5 bad: 60%
    config = make_config()
    configure_app(config)
    with pytest.raises(DatasetRefused) as refused:
        Producer(config, Ledger.from_url(redis_url, config.run.name)).enqueue([mixed])
    message = str(refused.value)
    assert f"{mixed}: 3 of 5 record(s) are bad (60%), more than dataset.max_bad_share = 0.5 allows" in message
    assert f"raise dataset.max_bad_share in {config.source}" in message and "Nothing was enqueued." in message
    assert f"{mixed}:1: malformed JSON" in message
    assert messages_waiting(redis_url) == 0

    raised = make_config(
        "raised.toml", dataset={"shard_size": 8, "thinking": "always", "max_bad_share": 0.6},
        storage={"url": str(tmp_path / "raised")}, run={"name": "raised", "state_dir": str(tmp_path / "state")},
    )
    report = Producer(raised, Ledger.from_url(redis_url, raised.run.name)).enqueue([mixed])
    assert report.staged == 2 and report.problems.total == 3 and messages_waiting(redis_url) == 1


def test_the_share_is_judged_per_file(make_config, redis_url, tmp_path):
    """A wrong-format file is not hidden by a large good one beside it."""
    good = write_lines(tmp_path / "good.jsonl", good_lines(40))
    wrong = write_lines(tmp_path / "wrong.jsonl", [*GARBAGE, *good_lines(1)])
    config = make_config()
    configure_app(config)
    with pytest.raises(DatasetRefused, match=rf"{wrong}: 3 of 4 record\(s\) are bad \(75%\)") as refused:
        Producer(config, Ledger.from_url(redis_url, config.run.name)).enqueue([good, wrong])
    assert f"{good}:" not in str(refused.value)
    assert messages_waiting(redis_url) == 0


class StagingLedger(Ledger):
    """Counts the shards the producer has staged: it reads their states once each, as it stages them."""

    staged = 0

    def states(self, shard_ids):
        shard_ids = list(shard_ids)
        self.staged += len(shard_ids)
        return super().states(shard_ids)


def test_no_message_leaves_before_the_first_records_are_judged_then_they_stream(make_config, redis_url, tmp_path):
    """Workers still get their first shards while the rest is staged, once PROBE_RECORDS records were read."""
    dataset = write_lines(tmp_path / "many.jsonl", good_lines(3 * PROBE_RECORDS))
    config = make_config(dataset={"shard_size": 64, "thinking": "always"})
    configure_app(config)
    ledger = StagingLedger.from_url(redis_url, config.run.name)
    events: list[tuple[str, int]] = []
    report = Producer(config, ledger).enqueue(
        [dataset], send=lambda *message: events.append(("send", ledger.staged)),
        on_total=lambda n: events.append(("total", n)),
    )
    assert report.enqueued == report.shards == 48
    first_send = next(i for i, (kind, _) in enumerate(events) if kind == "send")
    assert first_send < events.index(("total", 3 * PROBE_RECORDS))  # before the files were all read
    assert events[first_send][1] >= PROBE_RECORDS // 64  # not before the first records were judged


def test_a_fine_dataset_whose_shards_are_all_done_still_exits_0(make_config, redis_url):
    config = make_config()
    configure_app(config)
    ledger = Ledger.from_url(redis_url, config.run.name)
    first = Producer(config, ledger).enqueue([SAMPLE])
    storage = open_storage(config.storage.url)
    for shard_id in first.shard_ids:
        storage.write_bytes(shard_key(shard_id), b"done")
        ledger.set_state(shard_id, DONE)
    redis.Redis.from_url(redis_url).delete(GENERATE.queue)
    again = dflash_queue("enqueue", SAMPLE, "-c", config.source, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "shards: 7 (0 enqueued, 7 already done, 0 already queued)" in again.stdout
    assert messages_waiting(redis_url) == 0
