"""A real Flower process against the run's broker, read through its HTTP API, with real workers of both lanes."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from dflash_queue.broker.redis_server import free_port
from dflash_queue.errors import ConfigError
from dflash_queue.ops.flower import check_basic_auth, flower_argv
from dflash_queue.producer import Producer
from dflash_queue.queue.app import configure_app
from dflash_queue.runstate.ledger import DONE, Ledger
from dfq_testing.polling import wait_for_states

REPO = Path(__file__).resolve().parents[2]
SAMPLE = REPO / "examples" / "sharegpt_sample.jsonl"
AUTH = "ops:s3cret-pass"


class FlowerClient:
    def __init__(self, port: int, auth: str | None = AUTH) -> None:
        self.base = f"http://127.0.0.1:{port}"
        self.auth = auth

    def get(self, path: str) -> tuple[int, bytes]:
        request = urllib.request.Request(self.base + path)
        if self.auth:
            request.add_header("Authorization", "Basic " + base64.b64encode(self.auth.encode()).decode())
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read()

    def json(self, path: str):
        status, body = self.get(path)
        assert status == 200, (path, status, body[:500])
        return json.loads(body)


def wait_until(predicate, timeout: float, what: str, process: subprocess.Popen, log: Path):
    deadline = time.monotonic() + timeout
    while True:
        assert process.poll() is None, f"flower exited {process.returncode}:\n{log.read_text()[-3000:]}"
        try:
            value = predicate()
        except (urllib.error.URLError, ConnectionError, OSError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def first_lines(count: int, out: Path) -> Path:
    out.write_text("\n".join(SAMPLE.read_text().splitlines()[:count]) + "\n")
    return out


@pytest.mark.slow
def test_flower_sees_both_lanes_queues_and_finished_tasks(make_config, redis_url, start_worker, tmp_path):
    port = free_port()
    config = make_config(
        dataset={"shard_size": 8, "thinking": "never"},
        flower={"port": port, "max_tasks": 500},
        **{"generate.sampling": {"max_tokens": 8}},
    )
    configure_app(config)
    log = tmp_path / "flower.log"
    with open(log, "wb") as out:
        flower = subprocess.Popen(
            [sys.executable, "-m", "dflash_queue", "flower", "-c", config.source],
            env={**os.environ, "FLOWER_BASIC_AUTH": AUTH},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        client = FlowerClient(port)
        wait_until(lambda: client.get("/healthcheck")[0] == 200, 120, "flower to listen", flower, log)
        assert FlowerClient(port, auth=None).get("/api/workers")[0] == 401
        assert FlowerClient(port, auth="ops:wrong").get("/api/workers")[0] == 401

        # Two shards queued and no worker yet: Flower reads the lengths from Redis.
        ledger = Ledger.from_url(redis_url, config.run.name)
        report = Producer(config, ledger).enqueue([first_lines(16, tmp_path / "prompts.jsonl")])
        assert report.enqueued == 2
        lengths = {q["name"]: q["messages"] for q in client.json("/api/queues/length")["active_queues"]}
        assert lengths == {"generate": 2, "extract": 0, "audit": 0}

        workers = [start_worker(config, "generate"), start_worker(config, "extract")]
        wait_for_states(ledger, report.shard_ids, {DONE}, timeout=300, workers=workers)

        def finished_tasks():
            tasks = client.json("/api/tasks?state=SUCCESS").values()
            names = sorted(t["name"] for t in tasks)
            return tasks if names == ["dfq.extract"] * 2 + ["dfq.generate"] * 2 else None

        tasks = wait_until(finished_tasks, 120, "four finished tasks in flower", flower, log)
        generate_args = " ".join(t["args"] for t in tasks if t["name"] == "dfq.generate")
        assert all(shard_id in generate_args for shard_id in report.shard_ids)  # references, shown per task
        assert {t["worker"] for t in tasks} == {w.hostname for w in workers}

        listed = client.json("/api/workers?refresh=1")
        assert set(listed) >= {w.hostname for w in workers}
        for worker in workers:
            queues = [q["name"] for q in listed[worker.hostname]["active_queues"]]
            assert queues == [worker.lane]
        lengths = {q["name"]: q["messages"] for q in client.json("/api/queues/length")["active_queues"]}
        assert lengths == {"generate": 0, "extract": 0}  # the queues the workers consume (no audit worker here)

        status, body = client.get("/metrics")
        assert status == 200
        families = {f.name: f for f in text_string_to_metric_families(body.decode())}
        succeeded = {
            s.labels["task"]: s.value
            for s in families["flower_events"].samples
            if s.name == "flower_events_total" and s.labels["type"] == "task-succeeded"
        }
        assert succeeded == {"dfq.generate": 2.0, "dfq.extract": 2.0}
    finally:
        flower.terminate()
        flower.wait(timeout=30)


def test_flower_command_needs_basic_auth_and_a_broker(make_config, tmp_path):
    config = make_config()
    with pytest.raises(ConfigError, match="FLOWER_BASIC_AUTH is not set"):
        check_basic_auth({})
    with pytest.raises(ConfigError, match="entry 2 is not user:password"):
        check_basic_auth({"FLOWER_BASIC_AUTH": "a:b,nopassword"})
    assert check_basic_auth({"FLOWER_BASIC_AUTH": "a:b,c:d:e"}) == ["a", "c"]

    result = subprocess.run(
        [sys.executable, "-m", "dflash_queue", "flower", "-c", config.source],
        env={k: v for k, v in os.environ.items() if k != "FLOWER_BASIC_AUTH"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode != 0 and "FLOWER_BASIC_AUTH is not set" in result.stderr


def test_flower_arguments_follow_the_config(make_config, tmp_path):
    config = make_config(flower={"max_tasks": 1234, "persistent": True, "purge_offline_workers_s": 600})
    argv = flower_argv(config.flower, config.run, port=6000)
    assert argv[0] == "flower"
    assert "--port=6000" in argv and "--address=127.0.0.1" in argv
    assert "--max_tasks=1234" in argv and "--persistent=True" in argv
    assert f"--db={Path(config.run.state_dir) / 'flower.db'}" in argv
    assert "--purge_offline_workers=600" in argv
    assert not any(a.startswith("--basic_auth") for a in argv)  # the password stays in the environment
