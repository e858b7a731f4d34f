"""A process recognised later: running while it runs, not once it ended (even as a zombie, or with its pid taken by
another process), and "cannot tell" from another host or pid namespace."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from dflash_queue.queue.process_identity import ProcessIdentity


def identity_of_child(child: subprocess.Popen) -> ProcessIdentity:
    here = ProcessIdentity.of_this_process()
    with open(f"/proc/{child.pid}/stat") as stat:
        ticks = stat.read().rpartition(")")[2].split()[19]
    return replace(here, pid=child.pid, start_ticks=ticks)


def test_a_process_runs_until_it_ends_and_a_zombie_has_ended():
    assert ProcessIdentity.of_this_process().running() is True
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        identity = identity_of_child(child)
        assert identity.running() is True
        assert ProcessIdentity.from_json(json.loads(json.dumps(identity.to_json()))) == identity
        child.kill()
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # it has ended, and is not reaped yet
        # A zombie: its pid still exists.
        assert Path(f"/proc/{child.pid}").exists() and identity.running() is False
    finally:
        child.kill()
        child.wait()
    assert identity.running() is False


def test_another_process_under_the_same_pid_is_not_it():
    here = ProcessIdentity.of_this_process()
    assert replace(here, start_ticks=str(int(here.start_ticks) + 1)).running() is False


def test_from_another_host_or_pid_namespace_it_cannot_tell_and_says_why():
    here = ProcessIdentity.of_this_process()
    assert here.out_of_sight() == ""
    elsewhere = {
        "another host": replace(here, host=here.host + "-elsewhere"),
        "another pid namespace": replace(here, pid_namespace="pid:[1]"),
        "another boot": replace(here, boot_id="another-boot"),
        "not recorded": ProcessIdentity.from_json({}),
    }
    for why, identity in elsewhere.items():
        assert identity.running() is None and why in identity.out_of_sight()
