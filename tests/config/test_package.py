"""`dflash_queue.config` gives the assembled `Config` while every component's section imports the section base
from the same package: a component's section imported first must not meet a half-built assembly."""

from __future__ import annotations

import subprocess
import sys

import pytest

SECTIONS = [
    "dflash_queue.data.config",
    "dflash_queue.engines.config",
    "dflash_queue.lanes.config",
    "dflash_queue.ops.config",
    "dflash_queue.quality.config",
    "dflash_queue.queue.config",
    "dflash_queue.storage.config",
]


@pytest.mark.parametrize("module", SECTIONS)
def test_a_section_imported_first_then_the_assembly(module):
    code = f"import {module}\nfrom dflash_queue.config import Config, load_config\nprint(Config.__module__)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "dflash_queue.config.loading"


def test_an_unknown_name_is_an_attribute_error():
    import dflash_queue.config

    with pytest.raises(AttributeError, match="no_such_name"):
        dflash_queue.config.no_such_name  # noqa: B018


def test_the_package_gives_exactly_what_the_assembly_exports():
    import dflash_queue.config
    from dflash_queue.config import loading

    assert dflash_queue.config.__all__ == loading.__all__  # the lazy names are written twice: kept in step here
