"""What tests/conftest.py sets for every test process and every process a test starts."""

from __future__ import annotations

import os
import subprocess
import sys


def test_the_suites_processes_write_bytecode_whatever_the_shell_says(tmp_path):
    """Each test process collects, and each worker imports, from bytecode written once (see tests/conftest.py)."""
    (tmp_path / "probe_module.py").write_text("VALUE = 1\n")
    subprocess.run([sys.executable, "-c", "import probe_module"], cwd=tmp_path, env=dict(os.environ), check=True)
    assert list((tmp_path / "__pycache__").glob("probe_module.*.pyc"))
    assert not sys.dont_write_bytecode
