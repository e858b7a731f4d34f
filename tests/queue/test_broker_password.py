"""A broker that needs a password, workers logging in as a least-rights ACL user: a job completes, and the
password shows nowhere (worker logs, command lines, `status`, Flower, dead letters, systemd units). A wrong
password stops a worker at once, saying so. Real redis-server, real workers and Flower, the tiny model."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis

from dflash_queue.broker.redis_server import RedisServer, free_port
from dflash_queue.config import PASSWORD_ENV
from dflash_queue.data.readers import read_dataset
from dflash_queue.data.samples import Sample
from dflash_queue.deadletters import DeadLetters
from dflash_queue.faults import ENV
from dflash_queue.ops.flower import flower_argv
from dflash_queue.ops.systemd import InstallSettings, UnitLayout, env_file_text, render_units
from dflash_queue.producer import Producer
from dflash_queue.queue.launcher import WorkerProcess
from dflash_queue.runstate.ledger import DONE, Ledger
from dfq_testing.commands import dflash_queue
from dfq_testing.jobs import connect, first_lines
from dfq_testing.polling import wait_for_states

SAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sharegpt_sample.jsonl"
ADMIN_PASSWORD = "admin-Pw-7f3k"
WORKER_PASSWORD = "worker-Pw-9q2x"
FLOWER_AUTH = "ops:flower-pass"
pytestmark = pytest.mark.slow


@pytest.fixture
def locked_broker(tmp_path: Path, make_config):
    """A redis-server that needs a password, with a least-rights `worker` user; admin client for checks. The app
    goes back to the session's broker after: later tests publish through its pooled connections."""
    with RedisServer(tmp_path / "broker", password=ADMIN_PASSWORD, users={"worker": WORKER_PASSWORD}) as server:
        admin = redis.Redis.from_url(server.url, password=ADMIN_PASSWORD, decode_responses=True)
        admin.acl_log_reset()
        try:
            yield server, admin
        finally:
            connect(make_config("session.toml"))


def no_password_in(text: str | bytes, where: str) -> None:
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    for secret in (ADMIN_PASSWORD, WORKER_PASSWORD):
        assert secret not in text, f"the broker password shows in {where}"


def test_workers_log_in_as_a_least_rights_user_and_the_password_shows_nowhere(
    locked_broker, make_config, start_worker, tmp_path
):
    server, admin = locked_broker
    password_file = tmp_path / "broker.password"
    password_file.write_text(WORKER_PASSWORD + "\n")
    password_file.chmod(0o600)
    port = free_port()
    config = make_config(
        broker={"url": server.url, "username": "worker", "password_file": str(password_file),
                "visibility_timeout_s": 600, "task_timeout_s": 300},
        dataset={"shard_size": 4, "thinking": "never"},
        flower={"port": port},
        **{"generate.sampling": {"max_tokens": 8}},
    )
    connect(config)
    dataset = first_lines(SAMPLE, 8, tmp_path / "prompts.jsonl")
    ids = [s.id for s in read_dataset([dataset], max_record_bytes=1 << 20) if isinstance(s, Sample)]
    poison = {ENV: json.dumps({"generate_poison": [ids[1]]})}  # one dead letter, to look into
    workers = [start_worker(config, "generate", env=poison), start_worker(config, "extract")]

    ledger = Ledger.from_url(config.broker.connection_url(), config.run.name)
    report = Producer(config, ledger).enqueue([dataset])
    wait_for_states(ledger, report.shard_ids, {DONE}, timeout=240, workers=workers)
    [dead] = DeadLetters.from_url(config.broker.connection_url(), config.run.name).all()
    assert dead.sample_ids == [ids[1]]

    status = dflash_queue("status", "--json", "-c", config.source, timeout=120)
    assert status.returncode == 0, status.stderr[-3000:]
    assert json.loads(status.stdout)["broker"] == server.url
    no_password_in(status.stdout + status.stderr, "status")

    log = tmp_path / "flower.log"
    with open(log, "wb") as out:
        flower = subprocess.Popen([sys.executable, "-m", "dflash_queue", "flower", "-c", config.source],
                                  env={**os.environ, "FLOWER_BASIC_AUTH": FLOWER_AUTH}, stdout=out,
                                  stderr=subprocess.STDOUT)
    try:
        lengths = wait_for_flower_queues(port, flower, log)
        assert lengths == {"generate": 0, "extract": 0, "audit": 0}  # Flower logged in to read them
        no_password_in(Path(f"/proc/{flower.pid}/cmdline").read_bytes(), "Flower's command line")
    finally:
        flower.terminate()
        flower.wait(timeout=30)
    no_password_in(log.read_bytes(), "Flower's log")
    no_password_in(" ".join(flower_argv(config.flower, config.run)), "Flower's arguments")

    for worker in workers:
        no_password_in(Path(f"/proc/{worker.pid}/cmdline").read_bytes(), "a worker's command line")
    # The workers are logged in as the ACL user (the admin connection is the only other client).
    assert {c["user"] for c in admin.client_list() if c["id"] != str(admin.client_id())} == {"worker"}
    for worker in workers:
        worker.stop()
        text = worker.log_path.read_text(errors="replace")
        assert "worker:**@" in text  # Celery's banner shows the user, the password masked
        no_password_in(text, f"the {worker.lane} worker's log")

    # Dead letters as stored, the whole database's values, and what systemd would be given.
    records = admin.hgetall(f"dfq:{config.run.name}:dead")
    assert records
    no_password_in(json.dumps(records), "the dead letters")
    for key in admin.scan_iter(count=1000):
        if admin.type(key) == "string":
            no_password_in(admin.get(key) or "", f"key {key}")
    units = render_units(config.run, config.broker, UnitLayout(workers={"generate": ((0,),), "extract": ((0,),)}),
                         InstallSettings(config_path=Path(config.source)))
    no_password_in("".join(units.values()) + env_file_text(config.broker, config.storage), "the systemd units")
    no_password_in((server.directory / "redis.log").read_text(), "the broker's log")

    # Nothing the workers, the producer, status or Flower sent was refused to the worker user.
    assert admin.acl_log() == []


def wait_for_flower_queues(port: int, flower: subprocess.Popen, log: Path) -> dict[str, int]:
    import base64
    import urllib.error
    import urllib.request

    request = urllib.request.Request(f"http://127.0.0.1:{port}/api/queues/length")
    request.add_header("Authorization", "Basic " + base64.b64encode(FLOWER_AUTH.encode()).decode())
    deadline = time.monotonic() + 120
    while True:
        assert flower.poll() is None, f"flower exited {flower.returncode}:\n{log.read_text()[-3000:]}"
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return {q["name"]: q["messages"] for q in json.loads(response.read())["active_queues"]}
        except (urllib.error.URLError, ConnectionError, OSError):
            pass
        assert time.monotonic() < deadline, f"flower did not answer:\n{log.read_text()[-3000:]}"
        time.sleep(0.5)


def test_a_wrong_password_stops_the_worker_at_once_saying_so(locked_broker, make_config, tmp_path):
    server, _admin = locked_broker
    config = make_config(broker={"url": server.url, "username": "worker",
                                 "visibility_timeout_s": 600, "task_timeout_s": 300})
    started = time.monotonic()
    worker = WorkerProcess("generate", Path(config.source), {**os.environ, PASSWORD_ENV: "not-the-Pw-1"},
                           tmp_path / "wrong.log", hostname="wrong@test")
    try:
        code = worker.process.wait(timeout=60)
    finally:
        worker.stop(timeout=5)
    text = worker.log_path.read_text(errors="replace")
    assert code != 0 and time.monotonic() - started < 60, text
    assert "refuses user 'worker'" in text and "invalid username-password pair" in text
    assert "loading the generate engine" not in text  # stopped before the model was loaded
    assert "not-the-Pw-1" not in text and "Traceback" not in text
