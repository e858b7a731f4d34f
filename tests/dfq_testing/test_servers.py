"""The test servers' stop: the whole process group goes, even when the API process exits first and its engine core
does not."""

from __future__ import annotations

import sys

import psutil

from dfq_testing.polling import wait_until
from dfq_testing.servers import VllmServer

# An API process that exits on SIGTERM, and an "engine core" in its group that ignores SIGTERM.
STUBBORN_GROUP = """
import signal, subprocess, sys, time
core = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('core', flush=True); time.sleep(600)"])
print(core.pid, flush=True)
time.sleep(600)
"""


class StubbornServer(VllmServer):
    def command(self) -> list[str]:
        return [sys.executable, "-c", STUBBORN_GROUP]


def test_stop_kills_an_engine_core_that_outlives_its_api_process(tmp_path):
    server = StubbornServer(tmp_path / "model", tmp_path / "server.log")
    server.start(wait=False)

    def core_started() -> int | None:
        words = server.log.read_text().split()  # the core's pid and its "core", in either order
        pids = [int(word) for word in words if word.isdigit()]
        return pids[0] if pids and "core" in words else None

    core = psutil.Process(wait_until(core_started, 60, "the stand-in engine core"))
    try:
        server.stop(timeout=2)
        assert server.process.poll() is not None
        core.wait(timeout=10)  # raises psutil.TimeoutExpired while the core still runs
    finally:
        if core.is_running():
            core.kill()
