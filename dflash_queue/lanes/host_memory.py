"""Host memory of an extract worker: glibc's heap must give back the buffers of a pass once it is written.

An extract task allocates and frees buffers of a few MB to tens of MB per pass (states converted to the stored
dtype, pinned copies, the writer's rows). glibc serves allocations above its mmap threshold with mmap and
returns them to the system when freed, but its threshold is dynamic: every such buffer freed raises it to that
size, after which buffers of that size come from the heap and stay resident once freed. A worker's RSS then
grows with the number of passes it has run rather than staying at one pass's worth. Fixing the threshold
(which also turns the dynamic adjustment off) keeps large buffers on mmap.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

# mallopt parameter number of M_MMAP_THRESHOLD in glibc's malloc.h.
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 4 * 1024 * 1024


def fix_mmap_threshold(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Fix glibc's mmap threshold for this process; False (nothing changed) on a libc without mallopt."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError, TypeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    done = mallopt(M_MMAP_THRESHOLD, threshold) == 1
    if not done:
        log.warning("could not fix the malloc mmap threshold: extract worker memory may grow with its passes")
    return done
