"""vLLM engine cores forked from a server that has imported vLLM, for engines a test starts in its own process.

The product's engines start vLLM's engine core with the spawn method (engines/vllm/runtime.prepare_environment):
each engine core imports vLLM again, about 12 CPU-seconds on the 2-core dev machine (`import vllm.v1.engine.core`,
2026-12-06), and a test process starts several engines. Inside `forked_engine_cores()` they are forked from
multiprocessing's fork server instead, with `PRELOAD` imported once per test process; the engines and what they
compute are the same. Each child gets the environment of the process that starts it, as of its start (a fork
server's child would otherwise have the server's), and writes where the server does: the stdout and stderr the
test process had when `start_server()` ran (the test capture's files under pytest, which
`engines/vllm_runtime.OutputMark` reads back). What a library reads once as it is imported (libgomp's
OMP_NUM_THREADS) is read in the server, with the test process's environment when the server started.

Only the engine core moves: its model workers, if any, and every engine in a worker or in `run` are spawned as the
product spawns them. An engine core forked so is the server's child, and the server the test process's: both are
among the test process's descendants.
"""

from __future__ import annotations

import importlib
import multiprocessing.forkserver
import os
from collections.abc import Iterator
from contextlib import contextmanager
from multiprocessing.context import ForkServerContext, ForkServerProcess

import pytest

# What an engine core imports before it runs: the engine core, the CPU worker and the uniprocess executor.
PRELOAD = ("vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor", "vllm.v1.worker.cpu_worker")
# Where vLLM takes the context that starts engine cores (bound by name from vllm.utils.system_utils).
LAUNCHER = "vllm.v1.engine.utils"


class EngineCoreProcess(ForkServerProcess):
    """Forked from the server; runs with its starter's environment as of `start()`."""

    def start(self) -> None:
        self._starter_environment = dict(os.environ)
        super().start()

    def run(self) -> None:
        # Only what differs: emptying the environment first would leave setproctitle no room for vLLM's process
        # titles ("VLLM::EngineCore"), which the tests find the engine's processes by.
        for name in set(os.environ) - set(self._starter_environment):
            del os.environ[name]
        os.environ.update({k: v for k, v in self._starter_environment.items() if os.environ.get(k) != v})
        super().run()


class EngineCoreContext(ForkServerContext):
    Process = EngineCoreProcess  # type: ignore[assignment]


CONTEXT = EngineCoreContext()


def start_server() -> None:
    """Start this process's fork server, with `PRELOAD` imported, if it is not running (its output goes where
    this process's does now)."""
    multiprocessing.forkserver.set_forkserver_preload(list(PRELOAD))
    multiprocessing.forkserver.ensure_running()


@contextmanager
def forked_engine_cores() -> Iterator[None]:
    """Engines created inside fork their engine core from this process's fork server (started here)."""
    start_server()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(importlib.import_module(LAUNCHER), "get_mp_context", lambda: CONTEXT)
        yield
