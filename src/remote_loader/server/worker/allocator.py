"""The C allocator's thresholds in a worker (NOTE [ Worker allocator ]).

NOTE [ Worker allocator ]

glibc's malloc gives a block of at least M_MMAP_THRESHOLD bytes its own mmap, and returns the top
of the heap to the kernel (brk) once more than M_TRIM_THRESHOLD of it is free. Both start at
128 KiB and rise by themselves (the "dynamic threshold") when a mapped block is freed, up to
32 MiB and 64 MiB. Where a worker's thresholds stand when it starts making batches is inherited
from the fork server and from what the worker did before (another loader's workers forked first,
a worker_init_fn that happened to free a big block, MALLOC_* variables in the server's
environment): identical loaders in identical servers faulted 0 or 900-2,000 pages a batch by
server instance (benchmarks/RESULTS.md, "Two loaders in one server"), and at the starting
thresholds the heavy workload faulted 34,000 times a batch, 2.7x its CPU, on this VM where a
fault costs about 3.5 us. Issue 30 saw the same loader 1.6-2x slower beside another loader, and
"fixed" by a worker_init_fn that ran a matmul first (which frees a big block and so raises both
thresholds).

So every worker sets both thresholds at start to where the dynamic rule ends: blocks under
32 MiB come from the heap and are reused batch after batch, and up to 64 MiB of free heap is
kept for the next batch instead of being given back and faulted in again. That is memory a worker
may keep beyond what it uses (at most 64 MiB), the price torch's own workers pay once their
thresholds have risen. Blocks of 32 MiB and more are still mapped each time (glibc's highest
dynamic threshold; larger fixed ones would keep whole batches in every worker's heap). Other C
libraries keep their own policy: mallopt is glibc's.
"""

from __future__ import annotations

import ctypes
import os

# mallopt's parameter numbers, from glibc's malloc.h.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
WORKER_MMAP_THRESHOLD = 32 << 20  # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
WORKER_TRIM_THRESHOLD = 64 << 20  # twice it, as the dynamic rule sets it


def settle_allocator() -> bool:
    """Fixes this process's malloc thresholds (NOTE [ Worker allocator ]); False where the C
    library is not glibc, or it refused them."""
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION"):
            return False
        mallopt = ctypes.CDLL(None).mallopt
    except (ValueError, OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    # The mmap threshold first: setting either one turns the dynamic rule off for both.
    return bool(
        mallopt(M_MMAP_THRESHOLD, WORKER_MMAP_THRESHOLD)
        and mallopt(M_TRIM_THRESHOLD, WORKER_TRIM_THRESHOLD)
    )
