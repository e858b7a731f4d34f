"""Which libraries a piece of code imports, seen from a fresh interpreter: for checks that a command stays light."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterable


def imported_by(code: str, names: Iterable[str]) -> set[str]:
    """Those of `names` (top-level modules) in sys.modules once `code` has run in a new Python process."""
    names = list(names)
    script = f"{code}\nimport json as _json, sys as _sys\nprint(_json.dumps([n for n in {names!r} if n in _sys.modules]))\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    return set(json.loads(done.stdout.strip().splitlines()[-1]))
