from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from dflash_queue.lanes.registry import GENERATE
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.runstate.ledger import DONE, GENERATED, QUEUED, Ledger
from dflash_queue.shards.keys import prompts_key, shard_key
from dflash_queue.shards.prompts import decode_prompts
from dflash_queue.storage import open_storage
from dfq_testing.commands import dflash_queue
from dfq_testing.templates import ALTERNATING_TEMPLATE, THINKING_ONLY_TEMPLATE

REPO = Path(__file__).resolve().parent.parent
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"


def queued_messages(url: str) -> list[dict]:
    client = redis.Redis.from_url(url)
    return [json.loads(raw) for raw in client.lrange(GENERATE.queue, 0, -1)]


def test_enqueue_stages_shards_and_sends_reference_only_messages(make_config, redis_url):
    config = make_config()
    configure_app(config)
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([SAMPLE])

    assert report.samples == 50 and report.problems.total == 0
    assert report.shards == 7 and report.enqueued == 7  # 50 samples in shards of 8
    storage = open_storage(config.storage.url)
    staged = [decode_prompts(storage.read_bytes(prompts_key(s)), what=s) for s in report.shard_ids]
    assert sum(len(s) for s in staged) == 50
    assert all(sample.thinking for shard in staged for sample in shard)

    messages = queued_messages(redis_url)
    assert len(messages) == 7
    for message in messages:
        assert message["headers"]["task"] == "dfq.generate"
        assert message["content-type"] == "application/json"
        assert len(message["body"]) < 400  # references, not prompts
    assert set(ledger.states(report.shard_ids).values()) == {QUEUED}


def test_the_progress_total_is_known_once_the_files_are_read_and_matches_the_progress(make_config, redis_url):
    """enqueue's bar showed `68/?` to the end: the total is reported once the last file is read, before the last
    shards are reported, and equals everything reported."""
    config = make_config()
    events: list[tuple[str, int]] = []
    Producer(config, Ledger.from_url(redis_url, config.run.name)).enqueue(
        [SAMPLE], send=lambda *args: None, on_shard=lambda n: events.append(("shard", n)),
        on_total=lambda n: events.append(("total", n)),
    )
    totals = [n for kind, n in events if kind == "total"]
    assert totals == [50] and sum(n for kind, n in events if kind == "shard") == 50
    assert events[-1][0] == "shard"  # said while the last shards were still to come


def test_rerun_skips_queued_and_done_shards(make_config, redis_url):
    config = make_config()
    configure_app(config)
    ledger = Ledger.from_url(redis_url, config.run.name)
    first = Producer(config, ledger).enqueue([SAMPLE])
    storage = open_storage(config.storage.url)
    storage.write_bytes(shard_key(first.shard_ids[0]), b"done")
    ledger.set_state(first.shard_ids[0], DONE)

    again = Producer(config, ledger).enqueue([SAMPLE])
    assert again.shard_ids == first.shard_ids
    assert again.enqueued == 0 and again.skipped_done == 1 and again.skipped_queued == 6
    assert len(queued_messages(redis_url)) == 7

    # A lost broker (ledger and queue gone) re-queues exactly the shards that are not done.
    redis.Redis.from_url(redis_url).flushall()
    rebuilt = Producer(config, ledger).enqueue([SAMPLE])
    assert rebuilt.enqueued == 6 and rebuilt.skipped_done == 1
    assert len(queued_messages(redis_url)) == 6


def test_bad_records_and_duplicates_are_counted_and_the_rest_enqueued(make_config, redis_url, tmp_path):
    lines = SAMPLE.read_text().splitlines()[:10]
    dataset = tmp_path / "mixed.jsonl"
    dataset.write_text("\n".join([*lines[:5], "{broken", lines[0], '{"conversations": []}', *lines[5:]]) + "\n")
    config = make_config()
    configure_app(config)
    report = Producer(config, Ledger.from_url(redis_url, config.run.name)).enqueue([dataset])
    assert report.samples == 10 and report.duplicates == 1 and report.problems.total == 2
    text = "\n".join(report.lines())
    assert f"{dataset}:6: malformed JSON" in text
    assert f"{dataset}:8 [conversations]: empty conversation" in text


def test_length_filter_skips_prompts_that_leave_no_room_and_counts_them(make_config, redis_url, tmp_path):
    long_prompt = json.dumps({"conversations": [{"from": "human", "value": "tell me more " * 300}]})
    dataset = tmp_path / "lengths.jsonl"
    dataset.write_text("\n".join([*SAMPLE.read_text().splitlines()[:6], long_prompt]) + "\n")
    config = make_config(dataset={"shard_size": 8, "max_model_len": 600, "generation_budget": 200})
    configure_app(config)
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset])
    assert report.samples == 7 and report.staged == 6 and report.too_long.total == 1
    text = "\n".join(report.lines())
    assert f"{dataset}:7: prompt too long:" in text and "< 200 for generation inside max_model_len 600" in text
    assert ledger.counters()["skipped_too_long"] == 1 and ledger.counters()["enqueued_samples"] == 6
    assert 0 < report.max_prompt_tokens <= 400 and report.prompt_tokens >= report.max_prompt_tokens
    staged = decode_prompts(open_storage(config.storage.url).read_bytes(prompts_key(report.shard_ids[0])), what="p")
    assert len(staged) == 6


def test_conversations_the_chat_template_refuses_are_bad_records_and_the_run_goes_on(
    make_config, redis_url, tiny_model_with_template, tmp_path
):
    model = tiny_model_with_template(ALTERNATING_TEMPLATE)
    twice = json.dumps({"conversations": [{"from": "human", "value": "one"}, {"from": "human", "value": "two"}]})
    dataset = tmp_path / "roles.jsonl"
    dataset.write_text("\n".join([*SAMPLE.read_text().splitlines()[:4], twice, *SAMPLE.read_text().splitlines()[4:6]]) + "\n")
    config = make_config(model={"path": str(model)})
    configure_app(config)
    ledger = Ledger.from_url(redis_url, config.run.name)
    report = Producer(config, ledger).enqueue([dataset])
    assert report.samples == 7 and report.refused == 1 and report.staged == 6 and report.too_long.total == 0
    text = "\n".join(report.lines())
    assert "1 refused by the chat template, 6 staged" in text
    assert f"{dataset}:5: chat template refused the conversation: Conversation roles must alternate" in text
    assert ledger.counters()["bad_records"] == 1 and ledger.counters()["enqueued_samples"] == 6
    staged = decode_prompts(open_storage(config.storage.url).read_bytes(prompts_key(report.shard_ids[0])), what="p")
    assert len(staged) == 6


def test_a_failed_send_leaves_no_queued_state_behind(make_config, redis_url):
    config = make_config()
    configure_app(config)
    ledger = Ledger.from_url(redis_url, config.run.name)
    sent: list[str] = []

    def flaky_send(shard_id: str, num_samples: int, fingerprint: str) -> None:
        if len(sent) == 3:
            raise ConnectionError("broker went away")
        sent.append(shard_id)

    with pytest.raises(ConnectionError):
        Producer(config, ledger, length_filter=False).enqueue([SAMPLE], send=flaky_send)
    states = ledger.states()
    assert set(states) == set(sent) and set(states.values()) == {QUEUED}
    # The rerun sends exactly the shards whose messages never went out.
    again: list[str] = []
    report = Producer(config, ledger, length_filter=False).enqueue([SAMPLE], send=lambda s, n, f: again.append(s))
    assert report.skipped_queued == 3 and set(again) == set(report.shard_ids) - set(sent)


def test_auto_thinking_and_all_turns_reach_the_staged_shards(make_config, redis_url):
    config = make_config(dataset={"shard_size": 64, "thinking": "auto", "regenerate": "all"})
    configure_app(config)
    report = Producer(config, Ledger.from_url(redis_url, config.run.name)).enqueue([SAMPLE])
    [shard_id] = report.shard_ids
    staged = decode_prompts(open_storage(config.storage.url).read_bytes(prompts_key(shard_id)), what=shard_id)
    assert 0 < report.thinking_on == sum(s.thinking for s in staged) < len(staged)
    assert all(s.regenerate == "all" and s.messages[-1].is_slot for s in staged)
    assert sum(s.num_turns for s in staged) > len(staged)


def test_rebuild_resends_every_shard_not_in_storage_whatever_the_ledger_says(make_config, redis_url):
    """A broker restored from an old copy: the ledger shows shards queued whose messages are gone."""
    config = make_config()
    configure_app(config)
    ledger = Ledger.from_url(redis_url, config.run.name)
    first = Producer(config, ledger).enqueue([SAMPLE])
    storage = open_storage(config.storage.url)
    storage.write_bytes(shard_key(first.shard_ids[0]), b"done")
    ledger.set_state(first.shard_ids[1], GENERATED)
    redis.Redis.from_url(redis_url).delete(GENERATE.queue)

    unchanged = Producer(config, ledger).enqueue([SAMPLE])
    assert unchanged.enqueued == 0 and unchanged.skipped_queued == 6 and queued_messages(redis_url) == []

    rebuilt = Producer(config, ledger).enqueue([SAMPLE], rebuild=True)
    assert rebuilt.enqueued == 6 and rebuilt.skipped_done == 1 and rebuilt.resent_in_progress == 6
    assert rebuilt.skipped_queued == 0 and rebuilt.pending_samples == 50 - 8
    sent = [message["headers"]["argsrepr"] for message in queued_messages(redis_url)]
    assert len(sent) == 6 and all(first.shard_ids[0] not in args for args in sent)
    assert set(ledger.states(first.shard_ids[1:]).values()) == {QUEUED}
    assert "rebuild: ledger ignored, 6 of those enqueued it showed queued or in progress" in "\n".join(rebuilt.lines())


def test_enqueue_command_rebuild_flag(make_config, redis_url):
    config = make_config()
    configure_app(config)
    Producer(config, Ledger.from_url(redis_url, config.run.name)).enqueue([SAMPLE])
    redis.Redis.from_url(redis_url).delete(GENERATE.queue)
    command = ("enqueue", SAMPLE, "-c", config.source)
    plain = dflash_queue(*command, timeout=120)
    assert plain.returncode == 0, plain.stderr
    assert "shards: 7 (0 enqueued, 0 already done, 7 already queued)" in plain.stdout
    rebuilt = dflash_queue(*command, "--rebuild", timeout=120)
    assert rebuilt.returncode == 0, rebuilt.stderr
    assert "shards: 7 (7 enqueued, 0 already done; rebuild: ledger ignored, 7 of those" in rebuilt.stdout
    assert len(queued_messages(redis_url)) == 7


def test_a_thinking_policy_the_template_cannot_honour_is_refused_before_anything_is_staged(
    make_config, redis_url, tiny_model_with_template, tmp_path
):
    """A thinking-only template (it opens <think> whatever enable_thinking says) with dataset.thinking = never:
    `enqueue` (and `run`, and the generate workers) refuse with the message `doctor` gives; nothing is staged."""
    from dflash_queue.errors import ConfigError

    model = tiny_model_with_template(THINKING_ONLY_TEMPLATE)
    config = make_config("never.toml", model={"path": str(model)}, dataset={"thinking": "never"})
    message = "dataset.thinking: the template always opens <think>: dataset.thinking = 'never' cannot be honoured"
    with pytest.raises(ConfigError, match=message):
        Producer(config, Ledger.from_url(redis_url, config.run.name))
    refused = dflash_queue("enqueue", SAMPLE, "-c", config.source, timeout=120)
    assert refused.returncode == 1 and message in refused.stderr
    run_out = tmp_path / "run-out"
    run = subprocess.run(
        [sys.executable, "-m", "dflash_queue", "run", str(SAMPLE), "-c", str(config.source), "-o", str(run_out)],
        capture_output=True, text=True, timeout=120,
    )
    assert run.returncode == 1 and message in run.stderr
    assert "started" not in run.stderr  # neither a broker nor a worker was started
    storage = open_storage(config.storage)
    assert list(storage.list("")) == [] and not run_out.exists()
    assert redis.Redis.from_url(redis_url).llen(GENERATE.queue) == 0
    always = make_config("always.toml", model={"path": str(model)}, dataset={"thinking": "always"})
    Producer(always, Ledger.from_url(redis_url, always.run.name))  # the same template honours "always"


def test_shards_are_staged_in_growing_groups_each_sent_once(make_config, redis_url):
    """Groups of 1, 2, 4, ... shards, so that workers get their first messages early (when they may leave: the
    first records judged, tests/test_bad_datasets.py)."""
    from dflash_queue.prompt_staging import growing_batches

    assert [len(b) for b in growing_batches(range(20), 8)] == [1, 2, 4, 8, 5]
    config = make_config(dataset={"shard_size": 2})
    configure_app(config)
    ledger = Ledger.from_url(redis_url, config.run.name)
    sent: list[str] = []
    report = Producer(config, ledger).enqueue([SAMPLE], send=lambda shard_id, *_: sent.append(shard_id))
    assert report.shards == 25 and sorted(sent) == sorted(report.shard_ids) and len(set(sent)) == 25
