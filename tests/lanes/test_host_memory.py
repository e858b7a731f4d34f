"""An extract worker's freed pass buffers go back to the system instead of staying on glibc's heap."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

SCRIPT = r"""
import ctypes, sys
if sys.argv[1] == "fixed":
    from dflash_queue.lanes.host_memory import fix_mmap_threshold
    assert fix_mmap_threshold()
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]

def rss():
    with open("/proc/self/statm") as handle:
        return int(handle.read().split()[1]) * 4096

def touched(size):
    pointer = libc.malloc(size)
    ctypes.memset(pointer, 1, size)
    return pointer

libc.free(touched(16 << 20))  # one large buffer freed: glibc's dynamic threshold rises to its size
base = rss()
passes = [touched(8 << 20) for _ in range(4)]  # a pass's buffers, smaller than that
keep = touched(1 << 20)  # allocated after them (at the top of the heap): nothing below it can be trimmed
for pointer in passes:
    libc.free(pointer)
print(rss() - base)
"""


def resident_after_free(mode: str) -> int:
    result = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return int(result.stdout)


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc behaviour")
def test_freed_pass_buffers_are_returned_once_the_threshold_is_fixed():
    assert resident_after_free("default") >= 24 << 20  # glibc keeps the 32 MB of freed buffers resident
    assert resident_after_free("fixed") < 4 << 20
