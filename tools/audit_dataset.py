#!/usr/bin/env python
"""Audit a dataset, completions or training shards; exits 1 when the stub share is over the limit.

    .venv/bin/python tools/audit_dataset.py PATH... [-c CONFIG] [--json] [--plot FILE.png] [--max-stub-fraction 0.05]

Same as `dflash-queue audit`.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_queue.cli.audit import audit  # noqa: E402

if __name__ == "__main__":
    audit(prog_name="audit_dataset.py")
