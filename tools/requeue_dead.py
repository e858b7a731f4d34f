#!/usr/bin/env python
"""Inspect, requeue and purge dead letters: `dflash-queue dead ...` as a script.

    python tools/requeue_dead.py list -c worker_configs/node.toml --lane extract
    python tools/requeue_dead.py requeue -c worker_configs/node.toml --all --exception InjectedFault --dry-run
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_queue.cli.reliability import dead  # noqa: E402

if __name__ == "__main__":
    dead(prog_name="requeue_dead.py")
