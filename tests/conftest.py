"""Session-wide real parts: a redis-server on a free port, the tiny Qwen3 model built locally, and an
S3-compatible endpoint (moto's threaded server) on loopback."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from dflash_queue import faults
from dflash_queue.broker.redis_server import RedisServer
from dflash_queue.config import Config, load_config
from dflash_queue.queue.app import configure_app
from dflash_queue.queue.launcher import WorkerProcess
from dfq_testing.configs import tiny_config_tables, write_config
from dfq_testing.forkserver import ForkServer, shared
from dfq_testing.s3 import TEST_CREDENTIALS, LoopbackS3
from dfq_testing.scheduling import GroupScheduling, order_longest_first
from dfq_testing.sentinel import SentinelGroup
from dfq_testing.servers import VllmServers
from dfq_testing.tiny_model import build_tiny_model
from dfq_testing.vllm_forkserver import forked_engine_cores
from dfq_testing.vllm_uniproc import uniproc_executor

REPO = Path(__file__).resolve().parent.parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# vLLM would report usage to its servers; tests reach no network.
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
# Where the shell sets PYTHONDONTWRITEBYTECODE (this machine's do), every test process would compile the package and
# rewrite the test modules again as it collects (20 CPU-seconds a test process instead of 14, 2-core AMD EPYC,
# 2026-12-06), and every worker it starts would compile the package again: the suite writes bytecode, as Python
# does by default (__pycache__/ is ignored by git; the bundles and wheels take sources only).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False


def pytest_configure(config: pytest.Config) -> None:
    """Under `-n N` (the default is three processes), one torch thread per process, in the test processes and the
    workers and engines they start: the suite is half waits (processes starting, workers polling, timeouts
    running out), which several processes overlap, and torch's threads in several processes on a machine with
    few cores mostly spin against each other (on the 2-core dev machine, 2026-12-05: two processes of two threads
    each were no faster than one process; two of one thread each took the suite from 44 to 28 min). vLLM's CPU
    workers would bind a thread to each core (VLLM_CPU_OMP_THREADS_BIND=auto) whatever OMP_NUM_THREADS says:
    "nobind" keeps them at one unbound thread too (the gpt-oss `run` test alone: 92 core-seconds bound, 79 not).
    Tests of the binding itself set or remove the variable."""
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the test processes, read as torch loads
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # a test process of `pytest -n N`
        order_longest_first(items)


def pytest_xdist_make_scheduler(config: pytest.Config, log) -> GroupScheduling:
    return GroupScheduling(config, log)


@pytest.fixture(scope="module")
def vllm_forked_engine_cores() -> Iterator[None]:
    """Engines the module starts in its process fork their engine core from a server that has imported vLLM
    (dfq_testing/vllm_forkserver.py): about 9 CPU-seconds less an engine with AVX-512, 12 without, after the test
    process's first."""
    with forked_engine_cores():
        yield


@pytest.fixture(scope="module")
def vllm_uniproc_executor() -> Iterator[None]:
    """The module's vLLM engines run their model in the engine core's process (dfq_testing/vllm_uniproc.py), for
    the modules that check what an engine computes."""
    with uniproc_executor():
        yield


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


@pytest.fixture(scope="session")
def trained_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M-Instruct, a small trained checkpoint (dfq_testing/trained_model.py), built once for the whole run:
    the test processes of `-n N` share one build (a lock beside it), which takes about 20 CPU-seconds."""
    from filelock import FileLock

    from dfq_testing.trained_model import build_trained_model

    shared_dir = tmp_path_factory.getbasetemp().parent  # the same for every test process of this run
    with FileLock(str(shared_dir / "trained-model.lock")):
        return build_trained_model(shared_dir / "smollm2-135m-instruct")


@pytest.fixture(scope="module")
def vllm_servers(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServers]:
    """`vllm serve` processes of the tiny model on loopback (at most two a module, each started when a test first
    asks for it: `vllm_servers.get(0)`), shared by a module's inference-server tests and stopped after them."""
    servers = VllmServers(tiny_model, tmp_path_factory.mktemp("vllm-servers"))
    yield servers
    servers.stop_all()


@pytest.fixture(scope="session")
def tiny_family(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """Build (once per session) the tiny checkpoint of a model family (dfq_testing.families)."""
    from dfq_testing.families import build_family

    def build(name: str) -> Path:
        return build_family(name, tmp_path_factory.getbasetemp() / f"family-{name}", tiny_model)

    return build


@pytest.fixture(scope="session")
def tiny_deep_family(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """Build (once per session) a deeper tiny checkpoint of a family whose layers are all alike
    (dfq_testing.families.UNIFORM_LAYERS; DEEP_LAYERS = 16 unless told), in a directory of its own."""
    from dfq_testing.families import DEEP_LAYERS, build_family

    def build(name: str, num_layers: int = DEEP_LAYERS) -> Path:
        out_dir = tmp_path_factory.getbasetemp() / f"family-{name}-{num_layers}-layers"
        return build_family(name, out_dir, tiny_model, num_layers=num_layers)

    return build


@pytest.fixture
def tiny_model_with_template(tiny_model: Path, tmp_path: Path) -> Callable[[str], Path]:
    """A copy of the tiny model whose chat template is replaced."""
    import shutil

    def make(template: str, name: str = "tiny-templated") -> Path:
        model = tmp_path / name
        shutil.copytree(tiny_model, model)
        (model / "chat_template.jinja").write_text(template)
        return model

    return make


@pytest.fixture
def make_config(tmp_path: Path, tiny_model: Path, redis_url: str) -> Callable[..., Config]:
    """Write a tiny-model config under tmp_path (with per-table overrides) and load it like a user would."""

    def make(name: str = "config.toml", **overrides: dict) -> Config:
        tables = tiny_config_tables(tiny_model, tmp_path / "storage", redis_url, tmp_path / "state")
        return load_config(write_config(tmp_path / name, tables, **overrides))

    return make


@pytest.fixture
def inject_faults() -> Iterator[Callable[[dict], None]]:
    """Install faults in this test's process (dflash_queue/faults.py); removed when the test ends."""
    yield faults.install
    faults.uninstall()


@pytest.fixture(scope="session")
def fork_server() -> ForkServer:
    """Forks `python -m dflash_queue ...` from a process that has imported the worker's libraries already
    (dfq_testing/forkserver.py): about 5 CPU-seconds less a worker on the 2-core machine."""
    return shared()


@pytest.fixture
def start_worker(tmp_path: Path, fork_server: ForkServer) -> Iterator[Callable[..., WorkerProcess]]:
    """Start real `dflash-queue worker` subprocesses (forked from `fork_server` when they can be); each is stopped
    (warmly, then killed) at teardown."""
    started: list[WorkerProcess] = []

    def start(
        config: Config,
        lane: str,
        *,
        wait: bool = True,
        extra_args: tuple[str, ...] = (),
        env: dict | None = None,
        prefix: tuple[str, ...] = (),
        hostname: str | None = None,
    ) -> WorkerProcess:
        """`hostname`: the node name (default: one of its own per worker; a restarted worker reuses one)."""
        name = hostname or f"{lane}-{len(started)}@{tmp_path.name[:40]}"
        environment = {**os.environ, **(env or {})}
        # Injected faults reach a worker only through the harness's wrapper, which installs them.
        injected = bool(environment.get(faults.ENV))
        if injected:
            environment["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), environment.get("PYTHONPATH")]))
        worker = WorkerProcess(
            lane,
            Path(config.source),
            environment,
            tmp_path / "logs" / f"{lane}-{len(started)}.log",
            hostname=name,
            extra_args=extra_args,
            prefix=prefix,
            module="dfq_testing.faulty_worker" if injected else "dflash_queue",
            popen=fork_server.popen,
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
    from dfq_testing.pipeline_shards import produce_training_shards

    return produce_training_shards(
        tiny_model, tmp_path_factory.mktemp("pipeline-shards"), hidden_dtypes=("float32", "bfloat16", "fp8_e4m3")
    )


@pytest.fixture(scope="session")
def peer_shards(tiny_family, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Config]:
    """Shards holding what every peer trainer reads, from the Qwen3 family (norm weights drawn, not all 1, so that
    a state before the norm and after it differ): three layers (an EAGLE-3 draft reads exactly three), then the
    last layer before the final norm and after it; float32 and bfloat16, the same 12 samples. Read-only."""
    from dfq_testing.pipeline_shards import produce_training_shards

    return produce_training_shards(
        tiny_family("qwen3"),
        tmp_path_factory.mktemp("peer-shards"),
        hidden_dtypes=("float32", "bfloat16"),
        extract={"layer_ids": [1, 2, 3], "last_layer_state": True, "final_norm_state": True},
    )


@pytest.fixture(scope="session")
def s3_server() -> Iterator[LoopbackS3]:
    server = LoopbackS3().start()
    yield server
    server.stop()


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> dict[str, str]:
    """AWS environment for the loopback endpoint: fake credentials, nothing from this machine's ~/.aws or an
    instance role. Worker subprocesses started afterwards inherit it."""
    for name in ("AWS_PROFILE", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    env = {
        **TEST_CREDENTIALS,
        "AWS_CONFIG_FILE": str(tmp_path / "no-aws-config"),
        "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path / "no-aws-credentials"),
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


@pytest.fixture
def s3_bucket(s3_server: LoopbackS3, s3_env: dict[str, str]) -> str:
    """A fresh bucket on the session's loopback endpoint."""
    return s3_server.create_bucket(f"dfq-test-{uuid.uuid4().hex[:12]}")


@pytest.fixture
def s3_tables(s3_server: LoopbackS3, s3_bucket: str) -> dict[str, dict]:
    """Config overrides that put a test's storage in its own bucket on the loopback endpoint."""
    return {
        "storage": {"url": f"s3://{s3_bucket}/run"},
        "storage.s3": {"endpoint_url": s3_server.endpoint_url, "max_attempts": 3, "connect_timeout_s": 2.0},
    }


@pytest.fixture
def sentinel_group(tmp_path: Path) -> Iterator[SentinelGroup]:
    """A primary, its replica and three sentinels on loopback (dfq_testing/sentinel.py), all stopped after the test;
    broker.url is `sentinel_group.url`, broker.sentinel_master `MASTER_NAME`."""
    group = SentinelGroup(tmp_path / "sentinel-group").start()
    yield group
    group.stop()
