"""How the process's C allocator treats the memory of freed tensors.

Holds ``keep_freed_memory`` (called by ``gradients.build_engine``, before the probe set's
allocations, and ``gradients.create_engine``, so by ``per_class_gradients`` and every actor) and
``OPT_OUT`` (the environment variable that turns it off).

Why: torch on a CPU allocates tensors with ``malloc``. glibc serves a block above its mmap
threshold (128 KiB at start, raised towards 32 MiB only as such blocks are freed) with a fresh
mapping, and hands free memory at the top of its heap back to the OS past its trim threshold
(twice the mmap threshold). A per-class run allocates and frees blocks of tens of MiB per group
of classes, so a fresh process's first call touched its memory anew again and again: HF ResNet
at C = 10,000, 624k page faults and 2.6 s of system time in an 11.8 s first call, 48k and 0.3 s in
the second. With the mmap threshold at its dynamic maximum and freed memory kept up to 1 GiB,
the first call faulted 120-290k pages and took 9.3-10.2 s, about the second's time (scratch
``getrusage`` runs around ``per_class_gradients``, not a repo command; ``python -m
benchmarks.projection_scale`` gives the cold / warm ratio). The price: a process keeps
up to ``TRIM_THRESHOLD`` of freed memory instead of returning it, which a compute process wants.

Only where the C library is glibc (``mallopt`` exists; elsewhere nothing is changed), only once
per process, and not when the process's own ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_TRIM_THRESHOLD_``
are set (the user chose) or ``CLASSGRAD_KEEP_FREED_MEMORY=0``. Setting only the trim threshold
would be worse than nothing: it turns the dynamic mmap threshold off at 128 KiB (the same call
then faulted 8.3M pages and took 22 s).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import sys

log = logging.getLogger(__name__)

OPT_OUT = "CLASSGRAD_KEEP_FREED_MEMORY"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's largest dynamic threshold (DEFAULT_MMAP_THRESHOLD_MAX, 64-bit)
TRIM_THRESHOLD = 1 << 30


@functools.cache  # once per process: later calls return the first answer
def keep_freed_memory() -> bool:
    """Raise glibc's mmap and trim thresholds once per process (see the module docstring).
    True when they are set (now or before), False when left as they were."""
    if os.environ.get(OPT_OUT, "1") == "0" or not sys.platform.startswith("linux"):
        return False
    if any(name in os.environ for name in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # no glibc
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # The mmap threshold first: it is what keeps the threshold off its 128 KiB start.
    done = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    log.debug("malloc keeps freed memory: %s", done)
    return done
