#!/usr/bin/env python
"""Write the systemd units and environment file for a node: `dflash-queue systemd install` as a script.

    python tools/install_units.py -c CONFIG --gpus 8 --generate 0-1,2-3,4-5 --extract 6,7 [--dest DIR]
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from dflash_queue.cli.ops import systemd_install  # noqa: E402

if __name__ == "__main__":
    systemd_install(prog_name="install_units.py")
