"""The commands that only read the broker (`status`, `dead`, `flower`) start in a second, not in the seconds torch
and Transformers take to import: nothing they import pulls either in."""

from __future__ import annotations

import pytest

from dfq_testing.imports import imported_by

# What `status`, `dead` and `suspects` import on their way to the broker: the broker check every command runs first,
# the run's private broker, the Celery app, the status figures and their table, the suspect shards.
BROKER_READERS = [
    "dflash_queue.cli.common",
    "dflash_queue.broker.run_broker",
    "dflash_queue.doctor.broker",
    "dflash_queue.queue.app",
    "dflash_queue.ops.status",
    "dflash_queue.ops.status_view",
    "dflash_queue.deadletters",
    "dflash_queue.cli.suspects",
    "dflash_queue.suspects",
]
HEAVY = ["torch", "transformers", "vllm"]


@pytest.fixture(scope="module")
def imported() -> set[str]:
    return imported_by("\n".join(f"import {name}" for name in BROKER_READERS), HEAVY)


@pytest.mark.parametrize("heavy", HEAVY)
def test_commands_that_read_the_broker_import_no_model_library(imported, heavy):
    assert heavy not in imported, f"{heavy} is imported"
