"""Load-time quantisation (--quant): float weights to q8_0 / q4_0 through the C
quantiser (kernels.quantize_rows), chunk by chunk, so that the float checkpoint and its
quantised copy are never in memory together."""

from __future__ import annotations

from kestrel_cli.core.osmem import drop_pages
from kestrel_cli.formats.weights import BLOCK_BYTES, QK, Weight
from kestrel_cli.runtime import kernels

_CHUNK_BYTES = 64 << 20  # source bytes quantised at a time


def quantize(w: Weight, to_fmt: str, threads: int | None = None) -> Weight:
    """A float weight (f32/f16/bf16, rows of whole blocks) as q8_0 or q4_0 (a new array).

    Works through ~64 MiB of source rows at a time and drops each chunk's pages from a
    memory-mapped source once quantised (`drop_pages`), so quantising at load never holds
    the float checkpoint and its quantised copy in memory together."""
    d, n = w.shape
    row = n // QK * BLOCK_BYTES[to_fmt]
    out = kernels.huge_buffer(d * row).reshape(d, row)  # decode streams it: huge pages
    step = max(1, _CHUNK_BYTES // max(1, w.data.strides[0]))
    for r0 in range(0, d, step):
        src = w.data[r0 : r0 + step]
        kernels.quantize_rows(
            Weight(w.fmt, src, (src.shape[0], n)), to_fmt, out[r0 : r0 + step], threads
        )
        drop_pages(src)
    return Weight(to_fmt, out, (d, n))
