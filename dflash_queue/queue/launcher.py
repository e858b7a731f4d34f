"""Lane workers as child processes: what `dflash-queue run`, the tests and the benchmarks start."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from celery import Celery


class ChildProcess(Protocol):
    """What a worker's launcher uses of `subprocess.Popen`."""

    pid: int
    returncode: int | None

    def poll(self) -> int | None: ...

    def wait(self, timeout: float | None = None) -> int: ...

    def send_signal(self, sig: int) -> None: ...


class WorkerProcess:
    def __init__(
        self,
        lane: str,
        config_path: Path,
        env: dict[str, str],
        log_path: Path,
        *,
        hostname: str | None = None,
        extra_args: tuple[str, ...] = (),
        prefix: tuple[str, ...] = (),
        module: str = "dflash_queue",
        popen: Callable[..., ChildProcess] = subprocess.Popen,
    ) -> None:
        """`prefix`: a command the worker runs under (e.g. `setpriv ...`); `module`: what `python -m` runs (the
        test harness's `dfq_testing.faulty_worker` installs injected faults first); `popen`: what starts it (the
        harness's forks the process from one that has imported the worker's libraries already)."""
        self.lane = lane
        self.log_path = log_path
        self.hostname = hostname
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(log_path, "ab")
        args = [*prefix, sys.executable, "-m", module, "worker", lane, "-c", str(config_path), *extra_args]
        if hostname:
            args += ["--hostname", hostname]
        self.process: ChildProcess = popen(
            args,
            env=env,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # Ctrl-C reaches the parent only; it stops workers itself, warmly.
        )

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    def error(self, chars: int = 64_000) -> str | None:
        """The error the worker command exited with (its last "Error: ..." line), None when it printed none."""
        lines = self.log_tail(chars).splitlines()
        return next((line.removeprefix("Error: ") for line in reversed(lines) if line.startswith("Error: ")), None)

    def wait_ready(self, app: Celery, timeout: float = 120.0) -> None:
        """Block until the worker answers a control ping (engine loaded, consuming)."""
        if not self.hostname:
            raise ValueError("wait_ready needs a hostname to ping")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"{self.lane} worker exited with {self.process.returncode}:\n{self.log_tail()}")
            # On a connection of its own: one from the app's pool stays behind mid-read of the reply queue, and
            # a process forked later (a DataLoader's workers) hangs closing it (see ops/status.py ask_workers).
            with app.connection_for_read() as connection:
                if app.control.ping(destination=[self.hostname], timeout=0.5, connection=connection):
                    return
            time.sleep(0.2)
        raise TimeoutError(f"{self.lane} worker not ready after {timeout}s:\n{self.log_tail()}")

    def terminate(self) -> None:
        """Warm shutdown: the running task finishes (or is requeued), then the worker exits."""
        if self.alive():
            self.process.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL the whole process group, as the OOM killer would."""
        if self.alive():
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def _sweep_group(self) -> None:
        """Kill what is left of the worker's process group once the worker is gone (an engine process that outlived
        it): the group is the worker's session, nothing else runs in it."""
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def stop(self, timeout: float = 60.0) -> None:
        self.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
        self._sweep_group()
        if not self._log.closed:
            self._log.close()
