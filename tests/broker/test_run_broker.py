"""The commands that read the broker (status, dead, verify) answer for a job `dflash-queue run` ran with an empty
broker.url: through its private redis-server while it is up, through its data in the state directory after."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from dflash_queue.broker.redis_server import RedisServer
from dflash_queue.broker.run_broker import forget_url, private_broker_dir, private_server, record_url
from dflash_queue.cli import main
from dflash_queue.deadletters import TASK, DeadLetter, DeadLetters, record_id
from dfq_testing.polling import wait_until
from dfq_testing.writes import WriteWatch

REPO = Path(__file__).resolve().parents[2]
DATASET = REPO / "examples" / "sharegpt_sample.jsonl"


def dead_letter(shard: str) -> DeadLetter:
    return DeadLetter(record_id(TASK, "generate", shard), TASK, "generate", "dfq.generate", shard,
                      exc_type="FileNotFoundError", message="gone")


def invoke(*args: str):
    return CliRunner().invoke(main, list(args))


def test_after_the_run_its_broker_data_answers(make_config):
    config = make_config(broker={"url": ""})
    with RedisServer(private_broker_dir(config.run)) as server:  # as `run` starts it
        DeadLetters.from_url(server.url, config.run.name).add(dead_letter("s1"))
    listed = invoke("dead", "list", "--json", "-c", config.source)
    assert listed.exit_code == 0, listed.output
    assert [record["shard_id"] for record in json.loads(listed.stdout)] == ["s1"]
    # In a process of its own, as an operator runs it: its control broadcast leaves Celery connections (subscribed
    # to the reply channel) in the process, which a later fork (a DataLoader's workers) would inherit.
    status = subprocess.run([sys.executable, "-m", "dflash_queue", "status", "--json", "-c", str(config.source)],
                            capture_output=True, text=True, timeout=120)
    assert status.returncode == 0, status.stderr[-3000:]
    assert set(json.loads(status.stdout)["lanes"]) == {"generate", "extract"}
    verified = invoke("verify", str(DATASET), "-c", config.source)
    assert "staged samples:" in verified.output and "Traceback" not in verified.output
    assert verified.exit_code == 1  # nothing of this dataset was enqueued: every sample missing, said so


def test_while_the_run_is_up_its_server_answers(make_config):
    config = make_config(broker={"url": ""})
    with RedisServer(private_broker_dir(config.run)) as server:
        record_url(server.directory, server.url)
        DeadLetters.from_url(server.url, config.run.name).add(dead_letter("live"))
        listed = invoke("dead", "list", "--json", "-c", config.source)
        forget_url(server.directory)
    assert listed.exit_code == 0 and [r["shard_id"] for r in json.loads(listed.stdout)] == ["live"]


def test_the_url_file_appears_only_with_the_whole_url_in_it(tmp_path, monkeypatch):
    """A trainer started with the run polls for broker.url (running_broker): a file made under its own name and then
    written could be read empty or cut short. While the URL is written, no file of that name is there."""
    import pathlib

    url = "redis://127.0.0.1:51234/0"
    watch = WriteWatch(tmp_path)
    real_open = pathlib.Path.open
    monkeypatch.setattr(pathlib.Path, "open", lambda self, *args, **kwargs: watch.wrap(real_open(self, *args, **kwargs)))
    record_url(tmp_path, url)
    monkeypatch.undo()
    assert watch.listings and all("broker.url" not in names for names in watch.listings)
    assert sorted(os.listdir(tmp_path)) == ["broker.url"]
    assert (tmp_path / "broker.url").read_text() == url + "\n"
    forget_url(tmp_path)
    assert os.listdir(tmp_path) == []


def test_no_broker_and_no_run_data_is_said_without_a_traceback(make_config):
    config = make_config(broker={"url": ""})
    for command in (["status"], ["dead", "list"], ["verify", str(DATASET)]):
        result = invoke(*command, "-c", config.source)
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert "broker.url is empty and" in result.output and "holds no data of a `dflash-queue run` job" \
            in result.output


def test_with_a_broker_password_the_private_server_asks_for_it(make_config, tmp_path, monkeypatch):
    (tmp_path / "broker.password").write_text("run-Secret-3\n")
    config = make_config(broker={"url": "", "username": "worker", "password_file": str(tmp_path / "broker.password")})
    server = private_server(config.run, config.broker).start()  # as `run` starts it
    try:
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(server.url).ping()
        live = config.with_overrides(broker={"url": server.url})
        DeadLetters.from_url(live.broker.connection_url(), config.run.name).add(dead_letter("guarded"))
        record_url(server.directory, server.url)
        listed = invoke("dead", "list", "--json", "-c", config.source)
        forget_url(server.directory)
    finally:
        server.stop()
    assert listed.exit_code == 0, listed.output
    assert [r["shard_id"] for r in json.loads(listed.stdout)] == ["guarded"]
    assert "run-Secret-3" not in (private_broker_dir(config.run) / "redis.log").read_text()
    # After the run, the server started on its data asks for the password too.
    after = invoke("dead", "list", "--json", "-c", config.source)
    assert after.exit_code == 0 and [r["shard_id"] for r in json.loads(after.stdout)] == ["guarded"]


def test_a_command_killed_while_it_reads_the_runs_data_leaves_no_server_running(make_config):
    config = make_config(broker={"url": ""})
    with RedisServer(private_broker_dir(config.run)) as server:  # as `run` leaves its data
        DeadLetters.from_url(server.url, config.run.name).add(dead_letter("s1"))
    reader = textwrap.dedent(f"""
        import sys
        from dflash_queue.broker.run_broker import broker_for_reading
        from dflash_queue.config import load_config as load
        with broker_for_reading(load({str(config.source)!r}), "status") as running:
            print(running.broker.url, flush=True)
            sys.stdin.read()
    """)
    command = subprocess.Popen([sys.executable, "-c", reader], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True)
    try:
        assert command.stdout is not None
        url = command.stdout.readline().strip()
        client = redis.Redis.from_url(url)
        assert client.ping()
        pid = int(client.info("server")["process_id"])
        command.kill()  # kill -9 mid-command: it cannot stop its server itself
    finally:
        command.kill()
        command.wait()
    wait_until(lambda: not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2],
               60, "the command's redis-server stopping")
