"""What the operating system says about memory: the machine's RAM, and giving freed heap
pages back to it. Used by the CLI (KV caches must fit), the server's admission budget and
image decoding."""
from __future__ import annotations

import os

_malloc_trim = None


def physical_memory() -> int | None:
    """This machine's RAM in bytes (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def available_memory() -> int | None:
    """Bytes the kernel says can be allocated without swapping (MemAvailable: free memory
    plus reclaimable page cache), None where it does not say (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) << 10
    except (OSError, ValueError, IndexError):
        pass
    return None


def return_freed_memory() -> None:
    """glibc keeps freed blocks smaller than its mmap threshold (which rises to as much as
    32 MiB as larger blocks are freed) in the heap, so a process's RSS stays at its
    high-water mark after a large request or image is gone. malloc_trim(0) gives those
    pages back; without glibc, nothing is done."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)
