"""Keeping the memory the simulator frees inside its process, for the length of a run.

The optimum (sim/optimal.py) recomputes arrays of peers x stages thousands of times per simulated hour:
at 10,000 peers and 8 stages each is 640 KB. glibc hands a block that large back to the kernel when it
is freed (it is mmap'ed above the allocator's threshold, or trimmed off the top of the heap), and the
next allocation faults its pages in again. At 10,000 peers x 1 simulated hour the kernel's share is
11.5 of 53 s; with the thresholds raised the same run takes 40 s, its summary unchanged (docs/LOG.md).
The cost is memory the process keeps once it has used it, bounded by
`TOP_PAD_BYTES` above the heap's peak.
"""

from __future__ import annotations

import ctypes
import ctypes.util

# mallopt parameters (glibc's malloc.h)
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest allowed on 64-bit: blocks up to this come from the heap
TRIM_THRESHOLD_BYTES = 256 * 2**20  # free memory kept at the heap's top before any is given back
TOP_PAD_BYTES = 64 * 2**20  # grow the heap in steps this large


def keep_freed_memory() -> bool:
    """Raise glibc's thresholds for this process; False (nothing changed) where the C library is not
    glibc or refuses a setting."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): their allocators are left as they are
        return False
    settings = (
        (M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
        (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
        (M_TOP_PAD, TOP_PAD_BYTES),
    )
    return all(mallopt(param, value) == 1 for param, value in settings)
