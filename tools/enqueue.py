#!/usr/bin/env python
"""Stage a dataset and enqueue its shards: `dflash-queue enqueue` as a script.

    python tools/enqueue.py DATASET... -c CONFIG
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_queue.cli.pipeline import enqueue  # noqa: E402

if __name__ == "__main__":
    enqueue(prog_name="enqueue.py")
