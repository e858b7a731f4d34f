"""`dflash-queue` commands as a user runs them, their output captured as text. Each is forked from this test
process's fork server (dfq_testing/forkserver.py), which has imported the package and its libraries already; an
environment that a library reads as it is imported gets a process started afresh."""

from __future__ import annotations

import subprocess
import sys

from dfq_testing.forkserver import shared


def dflash_queue(*args: object, env: dict[str, str] | None = None,
                 timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """`python -m dflash_queue ARGS...`, like `subprocess.run(..., capture_output=True, text=True)`."""
    return shared().run([sys.executable, "-m", "dflash_queue", *map(str, args)], env=env, timeout=timeout, text=True)
