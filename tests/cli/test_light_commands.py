"""The commands that only read the broker (`status`, `dead`, `flower`) start in a second, not in the seconds torch
and Transformers take to import: nothing they import pulls either in."""

from __future__ import annotations

import subprocess
import sys

import pytest

# What `status` and `dead` import on their way to the broker: the broker check every command runs first, the
# run's private broker, the Celery app, the status figures and their table.
BROKER_READERS = [
    "dflash_queue.cli.common",
    "dflash_queue.broker.run_broker",
    "dflash_queue.doctor.broker",
    "dflash_queue.queue.app",
    "dflash_queue.ops.status",
    "dflash_queue.ops.status_view",
    "dflash_queue.deadletters",
]


@pytest.mark.parametrize("heavy", ["torch", "transformers", "vllm"])
def test_commands_that_read_the_broker_import_no_model_library(heavy):
    script = (
        "import importlib, sys\n"
        f"for name in {BROKER_READERS!r}:\n"
        "    importlib.import_module(name)\n"
        f"print({heavy!r} in sys.modules)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "False", f"{heavy} is imported"
