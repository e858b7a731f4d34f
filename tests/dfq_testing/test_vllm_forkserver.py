"""vLLM's engine cores forked from a server that has imported vLLM (dfq_testing/vllm_forkserver.py): what vLLM starts
in the context is the server's child, with vLLM imported already and the environment its starter has as it starts.
tests/engines/vllm/test_vllm_extract.py checks an engine's processes so started."""

from __future__ import annotations

import json
import os

import psutil
import pytest

from dfq_testing.vllm_forkserver import forked_engine_cores, start_server

pytestmark = pytest.mark.vllm

REPORT = """\
import json, os, sys
from vllm.utils.system_utils import set_process_title
set_process_title("Probe")
with open({path!r}, "w") as out, open("/proc/self/comm") as title:
    json.dump({{"probe": os.environ.get("DFQ_FORKED_PROBE"), "parent": os.getppid(), "title": title.read().strip(),
               "vllm_imported": "vllm.v1.engine.core" in sys.modules}}, out)
"""


def test_vllm_starts_its_engine_core_from_the_server_with_its_starters_environment_as_it_starts(
    tmp_path, monkeypatch
):
    start_server()  # before the variable is set: the server's environment does not have it
    monkeypatch.setenv("DFQ_FORKED_PROBE", "set after the server started")
    seen = tmp_path / "seen.json"
    with forked_engine_cores():
        from vllm.v1.engine import utils  # where vLLM starts its engine cores

        process = utils.get_mp_context().Process(target=exec, args=(REPORT.format(path=str(seen)), {}))
        process.start()
        process.join(timeout=120)
    assert process.exitcode == 0
    report = json.loads(seen.read_text())
    assert report["probe"] == "set after the server started"
    assert report["title"] == "VLLM::Probe"  # the title the tests find vLLM's processes by
    assert report["vllm_imported"]  # imported by the server before it forked
    assert report["parent"] != os.getpid() and psutil.Process(report["parent"]).ppid() == os.getpid()
