"""`dflash-queue dead list|show|requeue|purge` and tools/requeue_dead.py on a real redis-server."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from pathlib import Path

import redis
from click.testing import CliRunner

from dflash_queue.cli import main
from dflash_queue.deadletters import MESSAGE, SAMPLE, TASK, DeadLetter, DeadLetters, exception_fields, record_id
from dflash_queue.lanes.registry import EXTRACT, GENERATE

REPO = Path(__file__).resolve().parents[2]


def seed(dead: DeadLetters) -> None:
    dead.add(DeadLetter(record_id(TASK, "generate", "g1"), TASK, "generate", "dfq.generate", "g1", ["g1", 8, "old"],
                        **exception_fields(FileNotFoundError("prompts/g1.jsonl"))), now=1000.0)
    for sample in ("a", "b"):
        dead.add(DeadLetter(record_id(SAMPLE, "extract", "e1", [sample]), SAMPLE, "extract", "dfq.extract", "e1",
                            ["e1", 8, "old"], {"redo": False}, [sample], **exception_fields(ValueError("nan"))))
    dead.add(DeadLetter(record_id(MESSAGE, "generate", task_id="m1"), MESSAGE, "generate", "",
                        args=["{bad"], exc_type="DecodeError", message="undecodable message"))


def test_list_show_and_filters(make_config, redis_url):
    config = make_config()
    seed(DeadLetters.from_url(redis_url, config.run.name))
    run = CliRunner().invoke
    listed = run(main, ["dead", "list", "-c", config.source])
    assert listed.exit_code == 0 and listed.stdout.splitlines()[-1] == "4 dead letter(s)"  # on stdout, counted
    assert "generate:g1  generate task    g1  FileNotFoundError" in listed.stdout
    extract = run(main, ["dead", "list", "-c", config.source, "--lane", "extract", "--json"])
    assert sorted(record["sample_ids"][0] for record in json.loads(extract.stdout)) == ["a", "b"]
    none = run(main, ["dead", "list", "-c", config.source, "--lane", "extract", "--kind", "message", "--json"])
    assert none.exit_code == 0 and json.loads(none.stdout) == []
    assert "generate:g1" in run(main, ["dead", "list", "-c", config.source, "--older-than", "1h"]).output
    assert run(main, ["dead", "list", "-c", config.source, "--older-than", "soon"]).exit_code == 2
    shown = run(main, ["dead", "show", "generate:g1", "-c", config.source])
    assert "exc_type: FileNotFoundError" in shown.output and "traceback:" in shown.output
    assert run(main, ["dead", "show", "nope", "-c", config.source]).exit_code == 1


def test_requeue_sends_one_message_per_shard_and_purge_confirms(make_config, redis_url):
    config = make_config()
    dead = DeadLetters.from_url(redis_url, config.run.name)
    seed(dead)
    broker = redis.Redis.from_url(redis_url)
    run = CliRunner().invoke
    dry = run(main, ["dead", "requeue", "--all", "-c", config.source, "--dry-run"])
    assert dry.output.count("would send") == 2 and "skipped: generate:message:m1" in dry.output
    assert broker.llen(GENERATE.queue) == broker.llen(EXTRACT.queue) == 0 and dead.count() == 4

    # Requeueing one poison sample takes its sibling too: the redo of shard e1 covers both.
    sent = run(main, ["dead", "requeue", "extract:e1:a", "-c", config.source])
    assert sent.exit_code == 0 and "sent: extract:e1:a, extract:e1:b: dfq.extract(e1, redo)" in sent.output
    [message] = [json.loads(m) for m in broker.lrange(EXTRACT.queue, 0, -1)]
    args, kwargs, _ = json.loads(base64.b64decode(message["body"]))
    assert args == ["e1", 8, config.fingerprint()] and kwargs == {"redo": True}
    assert run(main, ["dead", "requeue", "extract:e1:a", "-c", config.source]).output.count("sent") == 0

    # Purge asks first; --yes does not.
    refused = run(main, ["dead", "purge", "--all", "--kind", "message", "-c", config.source], input="n\n")
    assert refused.exit_code == 1 and dead.count() == 2
    purged = run(main, ["dead", "purge", "--all", "--kind", "message", "-c", config.source, "--yes"])
    assert purged.exit_code == 0 and dead.count() == 1
    assert run(main, ["dead", "requeue", "-c", config.source]).exit_code == 2  # neither ids nor --all


def test_tools_script_is_the_same_command(make_config, redis_url):
    config = make_config()
    seed(DeadLetters.from_url(redis_url, config.run.name))
    out = subprocess.run(
        [sys.executable, str(REPO / "tools" / "requeue_dead.py"), "list", "-c", config.source, "--lane", "generate"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "generate:g1" in out.stdout and "generate:message:m1" in out.stdout and "extract" not in out.stdout
