"""Host allocator settings for serving on a CPU.

glibc's malloc serves large blocks with `mmap` and adapts that threshold as blocks are freed;
each freed mmapped block goes back to the OS and the next one of its size is faulted in again,
one zeroed page at a time. A decode step allocates and frees tens of megabytes of activations
and logits whose sizes change with the batch, so until the threshold settles every step pays
those page faults, and the first system of a benchmark process decodes slower than the same
system run second. vLLM's CPU guide preloads tcmalloc for the same reason; fixing glibc's
thresholds at start-up does it without a preload: blocks up to 32 MiB come from the heap and
the heap keeps up to 256 MiB of free memory at its top.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import platform

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 << 20  # glibc's largest allowed value on 64-bit (4 MiB * sizeof(long))
TRIM_THRESHOLD = 256 << 20
DISABLE_ENV = "ASERVE_MALLOC_TUNING"  # "0" leaves glibc's defaults alone

_tuned = False


def tune_host_allocator() -> bool:
    """Fixes glibc's mmap and trim thresholds once per process. Returns whether they are set.

    Left alone where the allocator is not glibc's, where the user chose thresholds
    (MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_) or preloads another allocator
    (LD_PRELOAD), and when ASERVE_MALLOC_TUNING=0.
    """
    global _tuned
    if _tuned:
        return True
    if (os.environ.get(DISABLE_ENV) == "0" or platform.libc_ver()[0] != "glibc"
            or any(os.environ.get(name) for name in ("MALLOC_MMAP_THRESHOLD_",
                                                     "MALLOC_TRIM_THRESHOLD_"))
            or "malloc" in os.environ.get("LD_PRELOAD", "")):
        return False
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    _tuned = bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
                  and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _tuned:
        logger.warning("glibc refused the malloc thresholds; host allocations keep faulting")
    return _tuned
