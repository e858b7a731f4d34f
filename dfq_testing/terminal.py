"""Commands started as a terminal starts a foreground job, for the tests that press Ctrl-C."""

from __future__ import annotations

import signal
import subprocess


def foreground_job(command: list[str], *, own_group: bool = False) -> subprocess.Popen:
    """`command` with Ctrl-C (SIGINT) at its default, as a terminal's foreground job has it, whatever this process
    inherited: a shell without job control starts a background job (`pytest &` in a script) with SIGINT ignored,
    an ignored signal stays ignored across exec, and a Python started that way never raises KeyboardInterrupt.
    `own_group`: a process group of its own, which the terminal's Ctrl-C signals (`os.killpg`)."""
    # A handler (not an ignored signal) in this process becomes the default in the child at exec.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return subprocess.Popen(
            command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=own_group
        )
    finally:
        signal.signal(signal.SIGINT, previous)
