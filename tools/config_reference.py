#!/usr/bin/env python
"""Write docs/configuration.md from the configuration models, or check that it is current.

    .venv/bin/python tools/config_reference.py          # write it
    .venv/bin/python tools/config_reference.py --check  # exit 1 when it differs from the models
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from dflash_queue.config.reference import render_reference  # noqa: E402

TARGET = REPO / "docs" / "configuration.md"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="Only compare; exit 1 when the file is stale.")
    args = parser.parse_args()
    text = render_reference()
    if args.check:
        current = TARGET.read_text(encoding="utf-8") if TARGET.exists() else ""
        if current != text:
            print(f"{TARGET.relative_to(REPO)} is stale: run tools/config_reference.py", file=sys.stderr)
            return 1
        print(f"{TARGET.relative_to(REPO)} is current")
        return 0
    TARGET.write_text(text, encoding="utf-8")
    print(f"wrote {TARGET.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
