"""`python -m MODULE ...` processes forked from a server that has already imported what a worker imports.

A `dflash-queue worker` on the tiny model spends nearly all of its start, about 5.5 CPU-seconds, importing torch,
Transformers, Celery, boto3 and the package (2-core AMD EPYC, 2026-12-06); the suite starts about a hundred.
`ForkServer.popen` takes `subprocess.Popen`'s arguments and, for `python -m MODULE ARGS...` with its output in
files, forks the process from a server that imported those once, then runs MODULE as `python -m` would: the same
argv, environment, working directory, output and session. Any other command, or an environment that differs from
the server's in a variable a library may read as it is imported (anything but those named by `READ_LATE`), gets a
real `subprocess.Popen`. vLLM is not imported in advance: a vLLM worker imports it itself, as it starts.

The process returned has the part of `Popen`'s surface the harness uses (pid, returncode, poll, wait, send_signal,
terminate, kill). Its parent is the server, which reaps it and writes its exit code to a file the handle reads.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from dflash_queue.storage.process_dirs import pid_alive

# Read when used, not when a library is imported: these may differ from the server's environment.
READ_LATE = ("DFQ_", "AWS_", "PYTEST_CURRENT_TEST")
PRELOAD = (
    "dflash_queue.cli",
    "dflash_queue.queue.worker",
    "dflash_queue.lanes.generate",
    "dflash_queue.lanes.extract",
    "dflash_queue.engines.hf.generate",
    "dflash_queue.engines.hf.extract",
    "dflash_queue.storage.factory",
    "transformers.models.qwen3.modeling_qwen3",
    "celery.apps.worker",
    "celery.worker.consumer",
    "kombu.transport.redis",
    "boto3",
)


class ForkedProcess:
    """A process the server forked: `subprocess.Popen`'s pid, returncode, poll, wait and signals."""

    def __init__(self, args: list[str], pid: int, status_path: Path) -> None:
        self.args = args
        self.pid = pid
        self.returncode: int | None = None
        self._status_path = status_path

    def poll(self) -> int | None:
        if self.returncode is not None or (not self._status_path.exists() and pid_alive(self.pid)):
            return self.returncode
        # Reaped: the server writes the exit code just after (-1 when the server went first and cannot).
        deadline = time.monotonic() + 2
        while not self._status_path.exists() and time.monotonic() < deadline:
            time.sleep(0.01)
        self.returncode = int(self._status_path.read_text()) if self._status_path.exists() else -1
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.02)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """The server process (started at the first fork), and `popen` for the harness. `stop` ends the servers; the
    processes they forked live on until stopped like any other."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self._server: subprocess.Popen[bytes] | None = None
        self._retired: list[subprocess.Popen[bytes]] = []
        self._address = directory / "server.sock"
        self._environment: dict[str, str] = {}
        self._path: list[str] = []
        self.forked = 0  # processes forked (the others were started as real processes)

    def popen(self, args: list[str], *, env: dict[str, str] | None = None, stdout: Any = None, stderr: Any = None,
              start_new_session: bool = False) -> subprocess.Popen[bytes] | ForkedProcess:
        """`subprocess.Popen(args, ...)`, forked when `args` is `python -m ...` with its output in files (stderr in
        a file of its own, or subprocess.STDOUT)."""
        environment = dict(os.environ if env is None else env)
        forkable = (len(args) >= 3 and args[0] == sys.executable and args[1] == "-m" and hasattr(stdout, "fileno")
                    and (stderr == subprocess.STDOUT or hasattr(stderr, "fileno")))
        if forkable:
            self._start()
        if not forkable or not self._imports_alike(environment):
            return subprocess.Popen(args, env=environment, stdout=stdout, stderr=stderr,
                                    start_new_session=start_new_session)
        status = self.directory / "status" / uuid.uuid4().hex
        request = {"module": args[2], "args": args[3:], "env": environment, "cwd": os.getcwd(),
                   "new_session": start_new_session, "status": str(status)}
        streams = [stdout.fileno(), stdout.fileno() if stderr == subprocess.STDOUT else stderr.fileno()]
        with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as connection:
            connection.connect(str(self._address))
            socket.send_fds(connection, [json.dumps(request).encode()], streams)
            reply = json.loads(connection.recv(4096))
        self.forked += 1
        return ForkedProcess(args, reply["pid"], status)

    def run(self, args: list[str], *, env: dict[str, str] | None = None, timeout: float | None = None,
            text: bool = False) -> subprocess.CompletedProcess:
        """`subprocess.run(args, capture_output=True, ...)`, forked like `popen`."""
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            process = self.popen(args, env=env, stdout=out, stderr=err)
            try:
                code = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
                raise
            captured = []
            for stream in (out, err):
                stream.seek(0)
                data = stream.read()
                captured.append(data.decode().replace("\r\n", "\n").replace("\r", "\n") if text else data)
        return subprocess.CompletedProcess(args, code, *captured)

    def stop(self) -> None:
        for server in [*self._retired, *filter(None, [self._server])]:
            if server.poll() is None:
                server.terminate()
                server.wait(timeout=30)

    def _start(self) -> None:
        """Start a server unless one runs that imported with this process's environment as it is now (a test may
        change it: vLLM's in-process engine sets variables). A server left behind goes on reaping what it forked."""
        if self._server is not None and self._server.poll() is None:
            if self._imports_alike(dict(os.environ)):
                return
            self._retired.append(self._server)
        self._environment = dict(os.environ)
        environment = dict(self._environment)
        here = str(Path(__file__).resolve().parent.parent)
        environment["PYTHONPATH"] = os.pathsep.join(filter(None, [here, environment.get("PYTHONPATH")]))
        (self.directory / "status").mkdir(parents=True, exist_ok=True)
        self._address = self.directory / f"server-{len(self._retired)}-{uuid.uuid4().hex[:8]}.sock"
        self._server = subprocess.Popen([sys.executable, "-m", "dfq_testing.forkserver", str(self._address)],
                                        env=environment, stdout=subprocess.PIPE)
        assert self._server.stdout is not None
        ready = self._server.stdout.readline()
        if not ready:
            raise RuntimeError(f"the fork server exited with {self._server.wait()} before it was ready")
        self._path = json.loads(ready)["path"]

    def _imports_alike(self, environment: dict[str, str]) -> bool:
        """Whether a process with `environment` would import what the server imported, the same way."""
        keys = set(environment) | set(self._environment)
        for key in keys - {"PYTHONPATH"}:
            if environment.get(key) != self._environment.get(key) and not key.startswith(READ_LATE):
                return False
        wanted = environment.get("PYTHONPATH", "").split(os.pathsep)
        return all(entry in self._path for entry in wanted if entry)


_shared: ForkServer | None = None


def shared() -> ForkServer:
    """This process's server (one a test process), started at its first fork, stopped as the process exits."""
    global _shared
    if _shared is None:
        import atexit
        import shutil

        directory = Path(tempfile.mkdtemp(prefix="dfq-fork-server-"))
        _shared = ForkServer(directory)
        atexit.register(shutil.rmtree, directory, ignore_errors=True)
        atexit.register(_shared.stop)
    return _shared


def _serve(address: str) -> dict[str, Any] | None:
    """Import, then fork a process for each request until the client goes. Returns the request in a forked child
    (its stdout moved to the descriptor sent with it), None in the server when it stops."""
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    client = os.getppid()
    children: dict[int, Path] = {}
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as listener:
        listener.bind(address)
        listener.listen(16)
        print(json.dumps({"path": sys.path}), flush=True)
        while os.getppid() == client:
            _reap(children)
            if not select.select([listener], [], [], 0.05)[0]:
                continue
            connection, _ = listener.accept()
            with connection:
                message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
                request = json.loads(message)
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    listener.close()
                    os.dup2(fds[0], 1)
                    os.dup2(fds[1], 2)
                    for fd in set(fds):
                        os.close(fd)
                    return request
                for fd in fds:
                    os.close(fd)
                children[pid] = Path(request["status"])
                try:
                    connection.send(json.dumps({"pid": pid}).encode())
                except OSError:  # the client went (its test timed out): the child runs on, and is reaped
                    pass
    return None


def _reap(children: dict[int, Path]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        path = children.pop(pid, None)
        if path is not None:
            partial = path.with_suffix(".partial")
            partial.write_text(str(os.waitstatus_to_exitcode(status)))
            partial.rename(path)


def _become(request: dict[str, Any]) -> None:
    """Turn this forked child into `python -m MODULE ARGS...` as the client asked for it."""
    import runpy

    if request["new_session"]:
        os.setsid()
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if sys.path and sys.path[0] == os.getcwd():  # `python -m` puts the working directory first
        sys.path[0] = request["cwd"]
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [sys.argv[0], *request["args"]]
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    forked = _serve(sys.argv[1])
    if forked is not None:
        _become(forked)
