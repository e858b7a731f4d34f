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



def script_background_job(command: list[str]) -> subprocess.Popen:
    """`command` as a shell script's `command &` starts it: SIGINT (and SIGQUIT) ignored, as a shell without job
    control leaves a background job, in a process group of its own so that signals sent to the group reach only it
    and what stays in its group."""

    def as_background() -> None:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGQUIT, signal.SIG_IGN)

    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=as_background)

class TerminalJob:
    """`command` as the session leader of a terminal of its own (a pseudo-terminal), as a login shell's command is:
    closing the terminal (`hang_up`, a closed window, a dropped SSH session) sends it SIGHUP, and its writes to the
    terminal fail after. What it prints is read as it comes (a full terminal would block it) into `output`."""

    def __init__(self, command: list[str]) -> None:
        import os
        import pty
        import threading

        self._master, slave = pty.openpty()
        self.output = bytearray()
        self._hung_up = threading.Event()

        def controlling_terminal() -> None:  # in the child: a session of its own, this terminal its controller
            import fcntl
            import termios

            os.setsid()
            fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

        self.process = subprocess.Popen(command, stdin=slave, stdout=slave, stderr=slave,
                                        preexec_fn=controlling_terminal)
        os.close(slave)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        import os
        import select

        while not self._hung_up.is_set():
            if not select.select([self._master], [], [], 0.1)[0]:
                continue
            try:
                chunk = os.read(self._master, 65536)
            except OSError:  # the command and every process holding the terminal are gone
                break
            if not chunk:
                break
            self.output += chunk
        os.close(self._master)  # here, not while this thread may be reading it

    def hang_up(self) -> None:
        """Close the terminal: its controlling process gets SIGHUP from the kernel."""
        self._hung_up.set()
        self._reader.join()

    def text(self) -> str:
        return self.output.decode(errors="replace")
