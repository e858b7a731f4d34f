"""A process's own directories under a shared one, and those of this host's dead processes removed."""

from __future__ import annotations

import os
import subprocess
import sys

from dflash_queue.storage.process_dirs import host_tag, make_process_dir


def dead_pid() -> int:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(finished.stdout)


def test_tagged_directories_are_new_on_each_call_and_dead_processes_ones_are_removed(tmp_path):
    pid = dead_pid()
    first = make_process_dir(tmp_path, "dfq-states-", tagged=True)
    assert first.name.startswith(f"dfq-states-{host_tag()}-{os.getpid()}-")
    left = tmp_path / f"dfq-states-{host_tag()}-{pid}-0abc"
    left.mkdir()
    (left / "c1.0-x.safetensors").write_bytes(b"states")
    other_host = tmp_path / f"dfq-states-elsewhere-{pid}-0abc"
    other_host.mkdir()
    other_prefix = tmp_path / f"{host_tag()}-{pid}"  # not a transfer directory: another user's
    other_prefix.mkdir()
    second = make_process_dir(tmp_path, "dfq-states-", tagged=True)
    assert not left.exists()  # its process is gone
    assert first.is_dir() and second.is_dir() and first != second  # this process's: both kept
    assert other_host.is_dir()  # another host's: not this host's to judge
    assert other_prefix.is_dir()


def test_an_untagged_directory_is_the_processes_one_and_a_running_processes_is_kept(tmp_path):
    base = tmp_path / "staging"
    abandoned = base / f"{host_tag()}-{dead_pid()}"
    abandoned.mkdir(parents=True)
    (abandoned / "x.part").write_bytes(b"left over")
    alive = base / f"{host_tag()}-{os.getppid()}"
    alive.mkdir()
    mine = make_process_dir(base)
    assert mine == base / f"{host_tag()}-{os.getpid()}" and mine.is_dir()
    assert make_process_dir(base) == mine
    assert not abandoned.exists() and alive.is_dir()
