"""What each lane's worker would warn about at start (lanes/registry.py's `startup_warnings`, at the task slots it
runs by default): settings that contradict each other, such as an engine context that holds shorter sequences
than staging admits."""

from __future__ import annotations

from dflash_queue.config import Config
from dflash_queue.doctor.result import Check
from dflash_queue.errors import ConfigError
from dflash_queue.lanes.registry import LANES


def check_worker_settings(config: Config) -> list[Check]:
    """One check per lane: its worker's start-up warnings, or its task slots when there are none. Takes the whole
    Config: each lane's spec reads the sections its lane uses (lanes/registry.py)."""
    checks = []
    for spec in LANES.values():
        if not spec.in_use(config):
            continue
        slots = spec.default_slots(config)
        name = f"{spec.name} worker"
        try:
            warnings = spec.startup_warnings(config, slots)
        except ConfigError as exc:  # the model's context unreadable: the model check says why
            checks.append(Check.warned(name, f"cannot check the lane's settings: {exc}"))
            continue
        if warnings:
            checks.extend(Check.warned(name, warning) for warning in warnings)
        else:
            checks.append(Check.passed(name, f"{slots} task slot(s); the lane's settings agree"))
    return checks
