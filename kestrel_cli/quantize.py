"""Load-time quantisation (--quant): float weights to q8_0 / q4_0 through the C
quantiser (kernels.quantize_rows), chunk by chunk, so that the float checkpoint and its
quantised copy are never in memory together."""
from __future__ import annotations

import mmap

import numpy as np

from . import kernels
from .weights import BLOCK_BYTES, QK, Weight

_CHUNK_BYTES = 64 << 20                           # source bytes quantised at a time


def quantize(w: Weight, to_fmt: str, threads: int | None = None) -> Weight:
    """A float weight (f32/f16/bf16, rows of whole blocks) as q8_0 or q4_0 (a new array).

    Works through ~64 MiB of source rows at a time and drops each chunk's pages from a
    memory-mapped source once quantised (`drop_pages`), so quantising at load never holds
    the float checkpoint and its quantised copy in memory together."""
    d, n = w.shape
    row = n // QK * BLOCK_BYTES[to_fmt]
    out = kernels.huge_buffer(d * row).reshape(d, row)     # decode streams it: huge pages
    step = max(1, _CHUNK_BYTES // max(1, w.data.strides[0]))
    for r0 in range(0, d, step):
        src = w.data[r0:r0 + step]
        kernels.quantize_rows(Weight(w.fmt, src, (src.shape[0], n)), to_fmt, out[r0:r0 + step],
                              threads)
        drop_pages(src)
    return Weight(to_fmt, out, (d, n))


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
    lo, hi = -(-lo // page) * page, hi // page * page     # whole pages inside the array
    if hi > lo:
        try:
            mm.madvise(mmap.MADV_DONTNEED, lo, hi - lo)
        except (OSError, ValueError):
            pass
