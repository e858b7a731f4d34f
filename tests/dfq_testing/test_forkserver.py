"""The fork server starts `python -m MODULE ...` as a real process would start: the same argv, environment, working
directory, output, session and exit status, with the worker's libraries imported already."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from dfq_testing.forkserver import ForkedProcess, ForkServer


def start(server: ForkServer, log: Path, *args: str, env: dict[str, str] | None = None):
    with open(log, "ab") as output:
        return server.popen([sys.executable, "-m", "dfq_testing.process_report", *args], env=env, stdout=output,
                            stderr=subprocess.STDOUT, start_new_session=True)


def report(log: Path) -> dict:
    lines = log.read_text().splitlines()
    assert lines[1:] == ["to stderr"]
    return json.loads(lines[0])


def test_a_forked_process_is_started_as_asked(fork_server, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    env = {**os.environ, "DFQ_PROBE": "asked for"}
    process = start(fork_server, tmp_path / "out.log", "3", env=env)
    assert isinstance(process, ForkedProcess)
    assert process.wait(timeout=60) == 3 and process.returncode == 3 and process.poll() == 3

    seen = report(tmp_path / "out.log")
    assert seen["argv"][1:] == ["3"] and seen["argv"][0].endswith("dfq_testing/process_report.py")
    assert seen["main"] == "dfq_testing.process_report"
    assert seen["cwd"] == str(tmp_path)
    assert seen["env"] == env
    assert seen["session"] == seen["pid"] == process.pid  # a session of its own, like start_new_session
    assert seen["stdin"] == ""  # not the server's pipe
    assert seen["torch_imported"]  # imported by the server before the fork


def test_signals_reach_the_forked_process_and_its_status_reads_like_popens(fork_server, tmp_path):
    process = start(fork_server, tmp_path / "out.log", "wait")
    assert isinstance(process, ForkedProcess)
    assert process.poll() is None
    try:
        process.wait(timeout=0.2)
    except subprocess.TimeoutExpired:
        pass
    else:
        raise AssertionError("wait returned while the process was running")
    assert psutil.Process(process.pid).ppid() != os.getpid()  # the server's child, not this process's
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == -signal.SIGTERM


def test_an_environment_read_at_import_gets_a_real_process(fork_server, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "7"}  # read as torch loads: the server's import would be wrong
    process = start(fork_server, tmp_path / "out.log", "0", env=env)
    assert isinstance(process, subprocess.Popen)
    assert process.wait(timeout=120) == 0
    seen = report(tmp_path / "out.log")
    assert seen["env"]["OMP_NUM_THREADS"] == "7" and seen["session"] == process.pid


def test_run_captures_each_stream_like_subprocess_run(fork_server, tmp_path):
    forked = fork_server.forked
    result = fork_server.run([sys.executable, "-m", "dfq_testing.process_report", "5"], text=True, timeout=60)
    assert fork_server.forked == forked + 1
    assert result.returncode == 5 and result.stderr == "to stderr\n"
    assert json.loads(result.stdout)["argv"][1:] == ["5"]
    raw = fork_server.run([sys.executable, "-m", "dfq_testing.process_report", "0"], timeout=60)
    assert raw.stderr == b"to stderr\n"


def test_a_process_whose_environment_changed_forks_from_a_server_that_imported_with_the_change(tmp_path, monkeypatch):
    server = ForkServer(tmp_path / "servers")
    try:
        first = start(server, tmp_path / "first.log", "wait")
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "3")  # as vLLM's in-process engine sets its own
        second = start(server, tmp_path / "second.log", "0")
        assert isinstance(first, ForkedProcess) and isinstance(second, ForkedProcess)
        assert second.wait(timeout=60) == 0
        assert report(tmp_path / "second.log")["env"]["VLLM_CPU_KVCACHE_SPACE"] == "3"
        assert psutil.Process(first.pid).ppid() != psutil.Process(os.getpid()).pid
        first.send_signal(signal.SIGTERM)  # the first server, left behind, still reports its child's status
        assert first.wait(timeout=60) == -signal.SIGTERM
    finally:
        server.stop()


def test_the_harness_forks_its_workers_and_they_serve_and_stop_warmly(make_config, start_worker, fork_server):
    forked = fork_server.forked
    worker = start_worker(make_config(), "generate")  # waits for the worker's answer to a ping
    assert isinstance(worker.process, ForkedProcess) and fork_server.forked == forked + 1
    assert psutil.Process(worker.pid).ppid() != os.getpid()
    worker.stop(timeout=60)
    assert worker.process.returncode == 0, worker.log_tail()
    assert "Warm shutdown" in worker.log_tail()
