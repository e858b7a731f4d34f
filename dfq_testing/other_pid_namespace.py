"""`python -m dfq_testing.other_pid_namespace worker LANE -c CONFIG ...`: the `dflash-queue` command (with the faults
of `DFQ_INJECT_FAULTS` installed, as `dfq_testing.faulty_worker` does) in a pid namespace of its own, with its own
/proc, as a worker in another container of the same host runs: same host name, boot and network, but its pid is
1 and no process outside sees it by its pid, nor it them. Needs root (CAP_SYS_ADMIN), as `unshare --pid --fork
--mount-proc` does.

This process unshares the pid and mount namespaces, forks the command (pid 1 of the new namespace, killed when this
process dies), hands it SIGTERM and SIGINT, and exits as it did.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWPID = 0x20000000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18
PR_SET_PDEATHSIG = 1

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def unshare_available() -> str:
    """"" where a child can be given a pid namespace of its own here, else why not (tried in a throwaway child)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _libc.unshare(CLONE_NEWPID | CLONE_NEWNS) == 0 else 1)
    _, status = os.waitpid(pid, 0)
    return "" if os.waitstatus_to_exitcode(status) == 0 else "unshare(CLONE_NEWPID | CLONE_NEWNS) is not permitted"


def _run_command() -> None:
    """In the new namespaces: a /proc of this pid namespace (mounts kept from the host's), then the command."""
    _check(_libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PR_SET_PDEATHSIG)")
    _check(_libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None), "mount --make-rprivate /")
    _check(_libc.mount(b"proc", b"/proc", b"proc", 0, None), "mount -t proc proc /proc")
    from dflash_queue import faults
    from dflash_queue.cli import main as cli

    faults.install_from_environment()
    sys.argv = ["dflash-queue", *sys.argv[1:]]
    cli()


def main() -> None:
    _check(_libc.unshare(CLONE_NEWPID | CLONE_NEWNS), "unshare(CLONE_NEWPID | CLONE_NEWNS)")
    child = os.fork()
    if child == 0:
        _run_command()  # exits as the command does (SystemExit, or an exception's traceback and 1)
        sys.exit(0)

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, forward)
    _, status = os.waitpid(child, 0)
    code = os.waitstatus_to_exitcode(status)
    sys.exit(code if code >= 0 else 128 - code)


if __name__ == "__main__":
    main()
