"""Session-wide real parts: a redis-server on a free port and the tiny Qwen3 model built locally."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from dflash_queue.config import Config, load_config
from dflash_queue.queue.app import configure_app
from dflash_queue.queue.launcher import WorkerProcess
from dflash_queue.redis_server import RedisServer
from dflash_queue.testing.configs import tiny_config_tables, write_config
from dflash_queue.testing.tiny_model import build_tiny_model

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM would report usage to its servers; tests reach no network.
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis"), appendonly=True).start()
    yield server
    server.stop()


@pytest.fixture
def redis_url(redis_server: RedisServer) -> str:
    """A clean database on the session's redis-server."""
    redis.Redis.from_url(redis_server.url).flushall()
    return redis_server.url


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.getbasetemp() / "tiny-qwen3")


@pytest.fixture
def make_config(tmp_path: Path, tiny_model: Path, redis_url: str) -> Callable[..., Config]:
    """Write a tiny-model config under tmp_path (with per-table overrides) and load it like a user would."""

    def make(name: str = "config.toml", **overrides: dict) -> Config:
        tables = tiny_config_tables(tiny_model, tmp_path / "storage", redis_url, tmp_path / "state")
        return load_config(write_config(tmp_path / name, tables, **overrides))

    return make


@pytest.fixture
def start_worker(tmp_path: Path) -> Iterator[Callable[..., WorkerProcess]]:
    """Start real `dflash-queue worker` subprocesses; each is stopped (warmly, then killed) at teardown."""
    started: list[WorkerProcess] = []

    def start(config: Config, lane: str, *, wait: bool = True, extra_args: tuple[str, ...] = (), env: dict | None = None) -> WorkerProcess:
        name = f"{lane}-{len(started)}@{tmp_path.name[:40]}"
        worker = WorkerProcess(
            lane,
            Path(config.source),
            {**os.environ, **(env or {})},
            tmp_path / "logs" / f"{lane}-{len(started)}.log",
            hostname=name,
            extra_args=extra_args,
        )
        started.append(worker)
        if wait:
            worker.wait_ready(configure_app(config), timeout=180)
        return worker

    yield start
    for worker in started:
        worker.stop(timeout=30)



@pytest.fixture(scope="session")
def pipeline_shards(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Config]:
    """Shards made by the real generate and extract lanes: the same 12 samples (2 shards) extracted as
    float32, bfloat16 and fp8_e4m3; {hidden_dtype: config}. Read-only: copy before altering."""
    from dflash_queue.testing.pipeline_shards import produce_training_shards

    return produce_training_shards(
        tiny_model, tmp_path_factory.mktemp("pipeline-shards"), hidden_dtypes=("float32", "bfloat16", "fp8_e4m3")
    )
