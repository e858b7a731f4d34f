"""A run name or a storage location reused with other settings is refused, never reported done."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import redis

from dflash_queue.lanes.registry import GENERATE
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.queue.stale_messages import fingerprint_of
from dflash_queue.runstate.ledger import DONE, Ledger
from dflash_queue.runstate.run_identity import MANIFEST_KEY, RunIdentity, RunMismatch
from dflash_queue.shards.keys import completions_key, shard_key
from dflash_queue.storage import open_storage
from dfq_testing.checkpoints import fine_tune

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"


def queued(url: str) -> int:
    return redis.Redis.from_url(url).llen(GENERATE.queue)


def enqueue(config, **kwargs):
    configure_app(config)
    return Producer(config, Ledger.from_url(config.broker.connection_url(), config.run.name)).enqueue([SAMPLE], **kwargs)


def other_model(tiny_model: Path, tmp_path: Path) -> Path:
    """The same weights under another name: a model the fingerprint tells apart by its name."""
    copy = tmp_path / "tiny-other"
    shutil.copytree(tiny_model, copy)
    return copy


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ("model", ['model.name: "tiny-qwen3"; yours: "tiny-other"']),
        ("sampling", ["generate.sampling.temperature: 0.8; yours: 1.0"]),
        ("layers", ["extract.layer_ids: []; yours: [0, 1]"]),
        ("storage", ["storage: "]),
    ],
)
def test_a_rerun_under_one_run_name_with_other_settings_is_refused_and_says_what_differs(
    make_config, redis_url, tiny_model, tmp_path, change, expected
):
    first = make_config()
    report = enqueue(first)
    assert report.enqueued == 7 and queued(redis_url) == 7
    overrides = {
        "model": {"model": {"path": str(other_model(tiny_model, tmp_path)), "name": ""}},
        "sampling": {"generate.sampling": {"temperature": 1.0}},
        "layers": {"extract": {"layer_ids": [0, 1]}},
        "storage": {"storage": {"url": str(tmp_path / "storage-2")}},
    }[change]
    if change != "storage":
        overrides["storage"] = {"url": str(tmp_path / "storage-2")}
    second = make_config("second.toml", **overrides)

    with pytest.raises(RunMismatch) as refused:
        enqueue(second)
    message = str(refused.value)
    assert message.startswith("this broker's run `test` was made with model tiny-qwen3")
    assert "use another run.name, or --rebuild" in message
    for line in expected:
        assert line in message
    # Only extract settings differ: the completions are reusable.
    assert ("Only extract settings differ: `dflash-queue reextract" in message) == (change == "layers")
    assert queued(redis_url) == 7  # nothing more was sent
    assert not (tmp_path / "storage-2" / "prompts").exists()  # and nothing staged


def test_another_checkpoint_behind_the_same_path_is_refused_and_a_node_without_the_weights_is_not(
    make_config, redis_url, tiny_model, tmp_path
):
    model = shutil.copytree(tiny_model, tmp_path / "model")
    at_model = {"model": {"path": str(model), "name": "tiny-qwen3"}}
    first = make_config(**at_model)
    report = enqueue(first)
    assert report.enqueued == 7
    open_storage(first.storage.url).write_bytes(shard_key(report.shard_ids[0]), b"stored")  # output made
    fine_tune(model)  # the same config.json, name and tokenizer; other weights behind model.path

    with pytest.raises(RunMismatch) as refused:
        enqueue(make_config("again.toml", **at_model))
    message = str(refused.value)
    assert message.startswith(f"storage {first.storage.url} holds output made with model tiny-qwen3 and model.weights")
    assert re.search(r'\n  model\.weights: "[0-9a-f]{16}"; yours: "[0-9a-f]{16}"$', message), message
    with pytest.raises(RunMismatch) as refused:
        enqueue(make_config("elsewhere.toml", **at_model, storage={"url": str(tmp_path / "storage-2")}))
    message = str(refused.value)
    assert message.startswith("this broker's run `test` was made with model tiny-qwen3 and model.weights")
    assert re.search(r'\n  model\.weights: "[0-9a-f]{16}"; yours: "[0-9a-f]{16}"\n', message), message
    assert queued(redis_url) == 7

    # A node with the config and tokenizer only has no weights to compare: the rest decides, and is the same.
    weightless = shutil.copytree(model, tmp_path / "weightless", ignore=shutil.ignore_patterns("*.safetensors"))
    again = enqueue(make_config("weightless.toml", model={"path": str(weightless), "name": "tiny-qwen3"}))
    assert again.enqueued == 0 and again.skipped_done == 1 and again.skipped_queued == 6 and again.restarted == []


def test_an_unchanged_rerun_is_accepted_and_skips_everything(make_config, redis_url):
    config = make_config()
    first = enqueue(config)
    storage = open_storage(config.storage.url)
    for shard_id in first.shard_ids:
        storage.write_bytes(shard_key(shard_id), b"stored")
    again = enqueue(make_config("same-again.toml"))
    assert again.restarted == [] and again.enqueued == 0 and again.skipped_done == 7
    manifest = RunIdentity.from_json(storage.read_bytes(MANIFEST_KEY))
    assert manifest.fingerprint == config.fingerprint() and manifest.storage == storage.url


def test_rebuild_starts_a_run_made_with_other_settings_over_and_every_shard_is_sent(make_config, redis_url, tmp_path):
    first = make_config()
    report = enqueue(first)
    ledger = Ledger.from_url(redis_url, first.run.name)
    for shard_id in report.shard_ids:
        ledger.set_state(shard_id, DONE)  # done, in the first run's storage
    ledger.add({"extract_shards": 7})
    redis.Redis.from_url(redis_url).delete(GENERATE.queue)

    second = make_config("second.toml", **{"generate.sampling": {"temperature": 1.0}},
                         storage={"url": str(tmp_path / "storage-2")})
    rebuilt = enqueue(second, rebuild=True)
    assert rebuilt.enqueued == 7 and rebuilt.skipped_done == 0 and queued(redis_url) == 7
    assert "generate.sampling.temperature: 0.8; yours: 1.0" in rebuilt.restarted
    assert "rebuild: the run had been made with other settings and was started over:" in "\n".join(rebuilt.lines())
    assert ledger.counters() == {"enqueued_samples": 50}  # the first run's counters are gone
    assert set(ledger.states(report.shard_ids).values()) == {"queued"}
    # The run is now the second config's: a plain rerun of it is accepted, one of the first is refused.
    assert enqueue(second).restarted == []
    with pytest.raises(RunMismatch):
        enqueue(make_config("first-again.toml"))


def test_a_storage_written_with_other_settings_is_refused_under_any_run_name(make_config, redis_url):
    report = enqueue(make_config())
    open_storage(make_config().storage.url).write_bytes(shard_key(report.shard_ids[0]), b"stored")
    other = make_config("other.toml", run={"name": "another-run"}, **{"generate.sampling": {"temperature": 1.0}})
    with pytest.raises(RunMismatch) as refused:
        enqueue(other, rebuild=True)  # a rebuild resets a run's ledger, never somebody's storage
    message = str(refused.value)
    assert message.startswith(f"storage {other.storage.url} holds output made with model tiny-qwen3 and "
                              "generate.sampling.temperature = 0.8")
    assert "Use another output location (-o or storage.url)" in message
    assert "generate.sampling.temperature: 0.8; yours: 1.0" in message
    assert Ledger.from_url(redis_url, "another-run").states() == {}


def test_shards_the_ledger_shows_done_without_a_training_file_are_sent_again(make_config, redis_url):
    config = make_config()
    first = enqueue(config)
    ledger = Ledger.from_url(redis_url, config.run.name)
    storage = open_storage(config.storage.url)
    for shard_id in first.shard_ids:
        ledger.set_state(shard_id, DONE)
    storage.write_bytes(shard_key(first.shard_ids[0]), b"stored")
    redis.Redis.from_url(redis_url).delete(GENERATE.queue)

    again = enqueue(config)
    assert again.skipped_done == 1 and again.resent_missing == 6 and again.enqueued == 6
    assert queued(redis_url) == 6
    assert "sent again: 6 shard(s) the ledger showed done have no training file in storage" in "\n".join(again.lines())


def test_identity_round_trips_and_names_only_what_differs(make_config, tmp_path):
    config = make_config()
    mine = RunIdentity.of(config, str(tmp_path / "a"))
    assert RunIdentity.from_json(mine.to_json()) == mine
    assert mine.differences(mine) == []
    other = RunIdentity.of(make_config("b.toml", dataset={"thinking": "never"}), str(tmp_path / "b"))
    assert other.differences(mine) == [
        'dataset.thinking: "never"; yours: "always"',
        f"storage: {tmp_path / 'b'}; yours: {tmp_path / 'a'}",
    ]
    assert json.loads(mine.to_json())["fingerprint"] == config.fingerprint()


@pytest.mark.parametrize("made", ["completions", "shard", "rebuild"])
def test_output_holding_a_completion_or_a_shard_stays_refused_even_with_rebuild(make_config, redis_url, made):
    first = make_config()
    report = enqueue(first)
    storage = open_storage(first.storage.url)
    key = completions_key if made == "completions" else shard_key
    storage.write_bytes(key(report.shard_ids[0]), b"stored")
    with pytest.raises(RunMismatch, match=f"storage {storage.url} holds output made with model tiny-qwen3 and "
                                          "generate.sampling.temperature = 0.8"):
        enqueue(make_config("second.toml", **{"generate.sampling": {"temperature": 1.0}}), rebuild=made == "rebuild")
    assert RunIdentity.from_json(storage.read_bytes(MANIFEST_KEY)).fingerprint == first.fingerprint()
    assert queued(redis_url) == 7


def test_staged_only_output_of_other_settings_is_taken_over_with_its_broker_run_and_says_so(
    make_config, redis_url
):
    first = make_config()
    before = enqueue(first)
    assert queued(redis_url) == 7
    second = make_config("second.toml", **{"generate.sampling": {"temperature": 1.0}})
    report = enqueue(second)
    storage = open_storage(second.storage.url)
    assert report.enqueued == 7 and report.shard_ids == before.shard_ids
    took_over = [line for line in report.lines() if line.startswith("took over")]
    assert took_over == [
        f"took over {storage.url}: it held staged prompts only (no completion, no training shard), made with other "
        "settings (generate.sampling.temperature 0.8 -> 1.0); recorded as yours now; the broker's run `test` that "
        "staged them started over"
    ]
    assert RunIdentity.from_json(storage.read_bytes(MANIFEST_KEY)).fingerprint == second.fingerprint()
    # The first settings' messages are gone (a worker of the second would fail their shards): only the second's wait.
    waiting = redis.Redis.from_url(redis_url).lrange(GENERATE.queue, 0, -1)
    assert len(waiting) == 7 and {fingerprint_of(raw) for raw in waiting} == {second.fingerprint()}
    assert enqueue(make_config("second-again.toml", **{"generate.sampling": {"temperature": 1.0}})).took_over == ""


def test_a_broker_run_a_worker_is_working_on_is_not_taken_over(make_config, redis_url):
    """A worker holds a message of the first settings: it may be writing their output now."""
    first = make_config()
    enqueue(first)
    client = redis.Redis.from_url(redis_url)
    taken = client.lpop(GENERATE.queue)
    client.hset("unacked", "a-delivery-tag", json.dumps([json.loads(taken), "", GENERATE.queue]))
    with pytest.raises(RunMismatch, match="this broker's run `test` was made with model tiny-qwen3 and "
                                          "generate.sampling.temperature = 0.8"):
        enqueue(make_config("second.toml", **{"generate.sampling": {"temperature": 1.0}}))
    storage = open_storage(first.storage.url)
    assert RunIdentity.from_json(storage.read_bytes(MANIFEST_KEY)).fingerprint == first.fingerprint()
    assert queued(redis_url) == 6
