"""Every command that talks to the broker fails within seconds, in one line naming the setting to fix, when the
broker refuses the login (wrong password, none given, a wrong user) or does not answer; no traceback, exit 1.
A real redis-server that needs a password, as tests/queue/test_broker_password.py starts it."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from dflash_queue.broker.redis_server import RedisServer, free_port
from dflash_queue.cli import main
from dflash_queue.config import PASSWORD_ENV, PASSWORD_FILE_ENV
from dfq_testing.jobs import connect

REPO = Path(__file__).resolve().parents[2]
DATASET = REPO / "examples" / "sharegpt_sample.jsonl"
ADMIN_PASSWORD = "admin-Pw-4k2"
WORKER_PASSWORD = "worker-Pw-8s1"

COMMANDS = {
    "verify": ["verify", str(DATASET)],
    "enqueue": ["enqueue", str(DATASET)],
    "dead list": ["dead", "list"],
    "dead show": ["dead", "show", "generate:s1"],
    "dead requeue": ["dead", "requeue", "--all"],
    "dead purge": ["dead", "purge", "--all", "--yes"],
    "status": ["status"],
    "epoch": ["epoch"],
    "run": ["run", str(DATASET)],
    "flower": ["flower"],
}
# How each login goes wrong: (broker table, environment, what the one line must name).
FAILURES = {
    "wrong password": ({"username": ""}, {PASSWORD_ENV: "not-it-1"},
                       ["refuses the default user", "invalid username-password pair", PASSWORD_ENV]),
    "no password": ({"username": ""}, {}, ["needs a password and none is set", PASSWORD_ENV, PASSWORD_FILE_ENV,
                                          "broker.password_file"]),
    "wrong password file": ({"username": "worker", "password_file": "{tmp}/wrong.password"}, {},
                            ["refuses user 'worker'", "broker.password_file ({tmp}/wrong.password)",
                             "broker.username"]),
    "unknown user": ({"username": "nobody"}, {PASSWORD_ENV: WORKER_PASSWORD},
                     ["refuses user 'nobody'", "broker.username"]),
    "no answer": ({"url": "redis://127.0.0.1:{port}/0"}, {PASSWORD_ENV: WORKER_PASSWORD},
                  ["does not answer", "Connection refused", "broker.url"]),
}


@pytest.fixture(scope="module")
def locked_server(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("locked"), password=ADMIN_PASSWORD,
                     users={"worker": WORKER_PASSWORD}) as server:
        yield server


@pytest.fixture
def failing(locked_server, make_config, tmp_path, monkeypatch):
    """The config and environment of a login that goes wrong the way `case` says; the app back on the session's
    broker after (a command that got further would have pointed it at this one)."""
    for name in (PASSWORD_ENV, PASSWORD_FILE_ENV, "DFQ_BROKER_URL", "FLOWER_BASIC_AUTH"):
        monkeypatch.delenv(name, raising=False)
    (tmp_path / "wrong.password").write_text("not-it-2\n")
    port = free_port()

    def make(case: str):
        broker, env, named = FAILURES[case]
        broker = {k: v.format(tmp=tmp_path, port=port) for k, v in broker.items()}
        config = make_config(broker={"url": locked_server.url, "visibility_timeout_s": 600, "task_timeout_s": 300,
                                     **broker})
        return config, {**env, "FLOWER_BASIC_AUTH": "ops:pw"}, [n.format(tmp=tmp_path) for n in named]

    yield make
    connect(make_config("session.toml"))


@pytest.mark.parametrize("case", list(FAILURES))
@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_refused_or_unanswered_login_is_one_line_naming_the_setting(command, case, failing):
    config, env, named = failing(case)
    started = time.monotonic()
    result = CliRunner().invoke(main, [*COMMANDS[command], "-c", config.source], env=env)
    took = time.monotonic() - started
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: broker "), result.output
    for name in named:
        assert name in lines[0], (name, lines[0])
    for secret in (WORKER_PASSWORD, ADMIN_PASSWORD, "not-it-1", "not-it-2"):
        assert secret not in result.output
    assert took < 10, took


def test_from_a_shell_a_wrong_password_is_one_line_on_stderr_within_seconds(locked_server, make_config):
    config = make_config(broker={"url": locked_server.url, "visibility_timeout_s": 600, "task_timeout_s": 300})
    for command in (["status"], ["enqueue", str(DATASET)], ["dead", "list"]):
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-m", "dflash_queue", *command, "-c", config.source],
                                capture_output=True, text=True, timeout=60,
                                env={**__import__("os").environ, PASSWORD_ENV: "not-it-3"})
        assert result.returncode == 1 and time.monotonic() - started < 30, result.stderr[-2000:]
        assert result.stdout == "" and len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "refuses the default user" in result.stderr and PASSWORD_ENV in result.stderr
        assert "Traceback" not in result.stderr and "not-it-3" not in result.stderr


def test_the_right_login_gets_through(locked_server, make_config, monkeypatch):
    monkeypatch.setenv(PASSWORD_ENV, WORKER_PASSWORD)
    config = make_config(broker={"url": locked_server.url, "username": "worker", "visibility_timeout_s": 600,
                                 "task_timeout_s": 300})
    try:
        listed = CliRunner().invoke(main, ["dead", "list", "-c", config.source])
        assert listed.exit_code == 0 and listed.output.strip() == "0 dead letter(s)", listed.output
        assert redis.Redis.from_url(config.broker.connection_url()).ping()
    finally:
        connect(make_config("session.toml"))
