"""Lane workers as child processes (queue/launcher.py)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from dflash_queue.queue.app import configure_app
from dflash_queue.queue.launcher import WorkerProcess
from dfq_testing.jobs import channels_in_poll, forked_child_exits


def test_waiting_for_a_worker_leaves_no_connection_a_forked_process_would_hang_on(make_config, tmp_path):
    """`run` (and the tests) wait for a worker by pinging it, then go on in the same process; a DataLoader forked
    there later runs kombu's after-fork clean-up of the app's pooled connections, which must not block."""
    app = configure_app(make_config())
    # A process that lives but never answers a ping: the worker's command line, run by a script that only sleeps.
    idle = (sys.executable, "-c", "import time; time.sleep(60)")
    worker = WorkerProcess("generate", Path("unused.toml"), dict(os.environ), tmp_path / "worker.log",
                           hostname="nobody@test", prefix=idle)
    try:
        with pytest.raises(TimeoutError, match="generate worker not ready after"):
            worker.wait_ready(app, timeout=2.0)
    finally:
        worker.kill()
    assert channels_in_poll(app) == []
    assert forked_child_exits()
