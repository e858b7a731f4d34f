"""The signals that stop a command which owns workers and a broker (`run`, `reextract`): SIGINT (Ctrl-C, `kill
-INT`), SIGTERM (`kill`, `timeout`, a CI cancel, a container stop, a service manager) and SIGHUP (a closed
terminal, a dropped SSH session) all stop it as the first Ctrl-C does, raising `StopRequested` (a
KeyboardInterrupt) in the main thread: running tasks finish, the workers stop, the broker stops last. A second
signal while it stops stops it at once, every child still stopped.

SIGINT is taken whatever the process inherited: a shell without job control starts a background job (`run ... &`
in a script) with SIGINT ignored, and a Python started so never raises KeyboardInterrupt by itself.
"""

from __future__ import annotations

import os
import signal
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from types import FrameType

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class StopRequested(KeyboardInterrupt):
    """A stop signal arrived; `exit_code` is the shell's for a process that signal ended (128 + its number)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


def _silence_lost_terminal() -> None:
    """After a hang-up, writes to the terminal fail (EIO): stdout and stderr that are one go to /dev/null, so that
    stopping and its messages do not fail half-way. A log file stays as it is."""
    devnull = None
    for fd in (1, 2):
        try:
            # A terminal (a character device): isatty() is False on one hung up, as its ioctl fails too.
            if not stat.S_ISCHR(os.fstat(fd).st_mode):
                continue
            devnull = devnull if devnull is not None else os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, fd)
        except OSError:
            continue
    if devnull is not None:
        os.close(devnull)


def _stop(signum: int, frame: FrameType | None) -> None:
    if signum == signal.SIGHUP:
        _silence_lost_terminal()
    raise StopRequested(signum)


@contextmanager
def stopped_by_signals() -> Iterator[None]:
    """Within: SIGINT, SIGTERM and SIGHUP raise StopRequested in the main thread. The handlers before are put back
    after."""
    previous = {signum: signal.signal(signum, _stop) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
