"""What the operating system says about memory and what it is told: the machine's RAM,
giving freed heap pages back, and dropping a file mapping's pages. Used by the CLI (KV
caches must fit), the server's admission budget, image decoding and the loaders."""

from __future__ import annotations

import mmap
import os

import numpy as np

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


def _mmap_of(a: np.ndarray):
    """The mmap.mmap of the file an array's memory comes from (through an np.memmap: GGUF
    and safetensors), or None. An anonymous mapping (kernels.huge_buffer) is no file's:
    dropping its pages would zero them."""
    base, file = a, False
    while base is not None:
        file = file or isinstance(base, np.memmap)
        if isinstance(base, mmap.mmap):
            return base if file else None
        base = getattr(base, "base", None) if not isinstance(base, memoryview) else base.obj
    return None


def is_file_mapped(a: np.ndarray) -> bool:
    """Whether an array's memory is a file's mapping."""
    return _mmap_of(a) is not None


def drop_pages(a: np.ndarray) -> None:
    """Tell the kernel a memory-mapped array's pages are not needed for now (they leave
    this process's RSS; the page cache keeps them). No-op for ordinary arrays."""
    mm = _mmap_of(a)
    if mm is None or not hasattr(mm, "madvise") or not a.size:
        return
    start = np.frombuffer(mm, dtype=np.uint8).ctypes.data
    lo = a.ctypes.data - start
    hi = lo + a.nbytes
    page = mmap.PAGESIZE
    lo, hi = -(-lo // page) * page, hi // page * page  # whole pages inside the array
    if hi > lo:
        try:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):
            pass
