"""A weight matrix as stored on disk: its format, its raw (usually memory-mapped) bytes.

Formats and the layout of `data` (rows = output features, d x n logical):
  f32   float32 (d, n)
  f16   uint16  (d, n)   IEEE half bits
  bf16  uint16  (d, n)   bfloat16 bits (upper half of a float32)
  q8_0  uint8   (d, n/32*34)  blocks of 32: f16 scale d, 32 x int8 q;  x = d*q
  q4_0  uint8   (d, n/32*18)  blocks of 32: f16 d, 16 bytes; byte j holds element j in its
                              low nibble and element j+16 in its high nibble;  x = d*(q-8)
  q4_1  uint8   (d, n/32*20)  blocks of 32: f16 d, f16 m, 16 bytes as q4_0;  x = d*q + m
  q5_0  uint8   (d, n/32*22)  blocks of 32: f16 d, 4 bytes qh (bit k: element k's 5th bit),
                              16 bytes as q4_0;  x = d*(q-16)
  q5_1  uint8   (d, n/32*24)  blocks of 32: f16 d, f16 m, qh, 16 bytes;  x = d*q + m
  and GGUF's K-quants, super-blocks of 256 elements (n a multiple of 256):
  q2_k  uint8   (d, n/256*84)   16 sub-blocks of 16, 4-bit scale and min each, 2-bit q
  q3_k  uint8   (d, n/256*110)  16 sub-blocks of 16, 6-bit scales, 3-bit q (2 + a mask bit)
  q4_k  uint8   (d, n/256*144)  8 sub-blocks of 32, 6-bit scale and min each, 4-bit q
  q5_k  uint8   (d, n/256*176)  as q4_k with a 5th bit per element
  q6_k  uint8   (d, n/256*210)  16 sub-blocks of 16, int8 scales, 6-bit q
  and its non-linear 4-bit formats (a 16-value table): iq4_nl (d, n/32*18), blocks of 32
  with one f16 scale; iq4_xs (d, n/256*136), super-blocks of 256, 6-bit sub-block scales
  (pyx/formats.h spells out each layout). The NumPy reference for these is the gguf
  package's own dequantisation (gguf.quants.dequantize).
  and layouts made at load for decode, never on disk (pyx/gemv_x16.h):
  q4_0x16, q4_1x16, q4_kx16, q6_kx16, q8_0x16  uint8 (d, row bytes of q4_0 / q4_1 / q4_k /
                    q6_k / q8_0),
                    d a multiple of 16: the bytes of each 16 rows interleaved (data[i] is
                    not row i; `rows_x16`)
The block layouts are GGUF's (llama.cpp's), so GGUF tensors are used in place.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32  # elements per block of 32 (and activation block)
QK_K = 256  # elements per K-quant super-block
BLOCK_BYTES = {
    "q8_0": 34,
    "q4_0": 18,
    "q4_1": 20,
    "q5_0": 22,
    "q5_1": 24,
    "q2_k": 84,
    "q3_k": 110,
    "q4_k": 144,
    "q5_k": 176,
    "q6_k": 210,
    "iq4_nl": 18,
    "iq4_xs": 136,
    "q4_0x16": 18,
    "q4_1x16": 20,
    "q4_kx16": 144,
    "q6_kx16": 210,
    "q8_0x16": 34,
}
BLOCK_ELEMS = {f: (QK_K if f.endswith(("_k", "_xs", "_kx16")) else QK) for f in BLOCK_BYTES}
FORMATS = (
    "f32",
    "f16",
    "bf16",
    "q8_0",
    "q4_0",
    "q4_1",
    "q5_0",
    "q5_1",
    "q2_k",
    "q3_k",
    "q4_k",
    "q5_k",
    "q6_k",
    "iq4_nl",
    "iq4_xs",
    "q4_0x16",
    "q4_1x16",
    "q4_kx16",
    "q6_kx16",
    "q8_0x16",
)
X16_OF = {
    "q4_0": "q4_0x16",
    "q4_1": "q4_1x16",
    "q4_k": "q4_kx16",  # repacked for decode
    "q6_k": "q6_kx16",
    "q8_0": "q8_0x16",
}
X16_BASE = {v: k for k, v in X16_OF.items()}


def row_bytes(fmt: str, n: int) -> int:
    """Bytes a row of n elements takes in `fmt`'s storage. q6_kx16 keeps super-blocks in
    pairs (pyx/gemv_x16.h): a row of an odd number of them is 18 bytes longer (its group's
    last super-block has the D and S room of a pair, KX_6TAIL)."""
    qk = BLOCK_ELEMS[fmt]
    nb = n // qk
    return nb * BLOCK_BYTES[fmt] + (18 if fmt == "q6_kx16" and nb % 2 else 0)


# the gguf package's type of each format whose reference is gguf.quants.dequantize
_GGUF_REFERENCE = {
    "q5_0": "Q5_0",
    "q5_1": "Q5_1",
    "q2_k": "Q2_K",
    "q3_k": "Q3_K",
    "q4_k": "Q4_K",
    "q5_k": "Q5_K",
    "q6_k": "Q6_K",
    "iq4_nl": "IQ4_NL",
    "iq4_xs": "IQ4_XS",
}


@dataclass
class Weight:
    fmt: str  # one of FORMATS
    data: np.ndarray  # raw storage, see module docstring
    shape: tuple[int, int]  # logical (d, n)

    def __post_init__(self):
        if self.fmt not in FORMATS:
            raise ValueError(f"unknown weight format {self.fmt!r}")
        d, n = self.shape
        if self.fmt in BLOCK_BYTES:
            qk = BLOCK_ELEMS[self.fmt]
            assert n % qk == 0, f"{self.fmt} rows must be whole blocks of {qk}"
            assert self.data.shape == (d, row_bytes(self.fmt, n)), self.data.shape
        else:
            assert self.data.shape == (d, n), (self.data.shape, self.shape)

    @property
    def block_fmt(self) -> str:
        """The format of the blocks whatever their layout: q4_0 for q4_0x16 (the same
        blocks, interleaved for decode), else fmt."""
        return X16_BASE.get(self.fmt, self.fmt)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def rows(self, idx) -> np.ndarray:
        """Dequantised rows `idx` as float32 (len(idx), n)."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        if self.fmt in X16_BASE:
            base, n = X16_BASE[self.fmt], self.shape[1]
            return dequantize(base, rows_x16(self.fmt, self.data)[idx][:, : row_bytes(base, n)], n)
        return dequantize(self.fmt, self.data[idx], self.shape[1])

    def dequantize(self) -> np.ndarray:
        """The whole matrix as float32 (d, n) (tests and references only)."""
        return dequantize(self.fmt, self.data, self.shape[1])


def _f16(raw: np.ndarray) -> np.ndarray:
    return raw.view(np.float16).astype(np.float32)


def rows_x16(fmt: str, data: np.ndarray) -> np.ndarray:
    """The row-major q4_0 / q4_1 / q4_k / q8_0 bytes (d, row_bytes) of an x16 weight (NumPy
    reference of pyx/gemv_x16.h's layouts: per group of 16 rows and pair of blocks, the
    16 scales of each block (then q4_1's offsets), then each block's 4 x 64 quant bytes,
    lane r of vector k = row r's bytes 4k..4k+3; q4_k: per super-block 16 d, 16 dmin and
    the 12 scale bytes of each row byte-planar (256 bytes), then 32 x 64 quant bytes;
    q8_0: as q4_0 with 8 x 64 quant bytes a block; q6_k: _rows_q6_kx16)."""
    d, ldw = data.shape
    if fmt == "q6_kx16":
        return _rows_q6_kx16(data)
    if fmt == "q8_0x16":
        nb = ldw // 34
        pairs = np.ascontiguousarray(data).reshape(d // 16, nb // 2, 1088)
        q = pairs[:, :, 64:].reshape(d // 16, nb // 2, 2, 8, 16, 4)  # (g, p, b%2, k, r, 4)
        out = np.empty((d // 16, 16, nb, 34), dtype=np.uint8)
        out[..., 2:] = q.transpose(0, 4, 1, 2, 3, 5).reshape(d // 16, 16, nb, 32)
        sc = pairs[:, :, :64].reshape(d // 16, nb // 2, 2, 16, 2)  # (g, p, b%2, r, 2)
        out[..., 0:2] = sc.transpose(0, 3, 1, 2, 4).reshape(d // 16, 16, nb, 2)
        return out.reshape(d, ldw)
    if fmt == "q4_kx16":
        nsb = ldw // 144
        g = np.ascontiguousarray(data).reshape(d // 16, nsb, 2304)
        out = np.empty((d // 16, 16, nsb, 144), dtype=np.uint8)
        q = g[:, :, 256:].reshape(d // 16, nsb, 32, 16, 4).transpose(0, 3, 1, 2, 4)
        out[..., 16:] = q.reshape(d // 16, 16, nsb, 128)
        meta = g[:, :, :256]
        out[..., 0:2] = meta[:, :, 0:32].reshape(d // 16, nsb, 16, 2).transpose(0, 2, 1, 3)
        out[..., 2:4] = meta[:, :, 32:64].reshape(d // 16, nsb, 16, 2).transpose(0, 2, 1, 3)
        out[..., 4:16] = meta[:, :, 64:256].reshape(d // 16, nsb, 12, 16).transpose(0, 3, 1, 2)
        return out.reshape(d, ldw)
    q41 = fmt == "q4_1x16"
    bb, qo = (20, 4) if q41 else (18, 2)
    nb = ldw // bb
    mb = 128 if q41 else 64  # a pair of blocks: scales, then quants
    pairs = np.ascontiguousarray(data).reshape(d // 16, nb // 2, mb + 512)
    q = pairs[:, :, mb:].reshape(d // 16, nb // 2, 2, 4, 16, 4)  # (g, p, b%2, k, r, 4)
    out = np.empty((d // 16, 16, nb, bb), dtype=np.uint8)
    out[..., qo:] = q.transpose(0, 4, 1, 2, 3, 5).reshape(d // 16, 16, nb, 16)
    sc = pairs[:, :, :64].reshape(d // 16, nb // 2, 2, 16, 2)  # (g, p, b%2, r, 2)
    out[..., 0:2] = sc.transpose(0, 3, 1, 2, 4).reshape(d // 16, 16, nb, 2)
    if q41:
        m = pairs[:, :, 64:128].reshape(d // 16, nb // 2, 2, 16, 2)
        out[..., 2:4] = m.transpose(0, 3, 1, 2, 4).reshape(d // 16, 16, nb, 2)
    return out.reshape(d, ldw)


def _rows_q6_kx16(data: np.ndarray) -> np.ndarray:
    """rows_x16 of q6_kx16: per group of 16 rows and pair of super-blocks (6720 bytes) the
    16 f16 d of each (64 bytes), the 16 scales of each row byte-planar (2 x 256: scale j
    of row r at 16 j + r), then per super-block 48 vectors v = 24 h + 3 s + m of 64 bytes,
    lane r = row r's 4 bytes c: element 128 h + 32 m + 4 s + c's 6-bit q in the low 6
    bits, bits 2m, 2m + 1 of element 128 h + 96 + 4 s + c's q in the top 2
    -> row-major q6_k (ql[128], qh[64], scales[16], d). A row of an odd number of
    super-blocks (ldw = 420 p + 228) ends each group with the last one's KX_6TAIL: read as
    a pair whose partner's bytes are zero."""
    d, ldw = data.shape
    if ldw % 420:
        g, nsb = d // 16, ldw // 210
        tail = np.zeros((g, 6720 * (nsb // 2 + 1)), np.uint8)
        tail[:, : 16 * ldw] = np.ascontiguousarray(data).reshape(g, 16 * ldw)
        return _rows_q6_kx16(tail.reshape(d, -1))[:, : 210 * nsb]
    g, p = d // 16, ldw // 420
    pair = np.ascontiguousarray(data).reshape(g, p, 6720)
    out = np.empty((g, 16, p, 2, 210), dtype=np.uint8)  # (g, r, p, sb % 2, bytes)
    out[..., 208:210] = pair[:, :, :64].reshape(g, p, 2, 16, 2).transpose(0, 3, 1, 2, 4)
    out[..., 192:208] = pair[:, :, 64:576].reshape(g, p, 2, 16, 16).transpose(0, 4, 1, 2, 3)
    v = pair[:, :, 576:].reshape(g, p, 2, 2, 8, 3, 16, 4)  # (g, p, sb%2, h, s, m, r, c)
    q = np.empty((g, p, 2, 2, 4, 8, 16, 4), dtype=np.uint8)  # (g, p, sb%2, h, i, s, r, c)
    for m in range(3):
        q[:, :, :, :, m] = v[:, :, :, :, :, m] & 63
    q[:, :, :, :, 3] = (
        (v[:, :, :, :, :, 0] >> 6)
        | ((v[:, :, :, :, :, 1] >> 6) << 2)
        | ((v[:, :, :, :, :, 2] >> 6) << 4)
    )
    # -> (g, r, p, sb%2, h, i, k = 4 s + c)
    q = q.transpose(0, 6, 1, 2, 3, 4, 5, 7).reshape(g, 16, p, 2, 2, 4, 32)
    ql = np.empty((g, 16, p, 2, 2, 2, 32), dtype=np.uint8)  # (.., h, i % 2, k)
    for i in range(2):
        ql[..., i, :] = (q[..., i, :] & 15) | ((q[..., i + 2, :] & 15) << 4)
    qh = np.zeros((g, 16, p, 2, 2, 32), dtype=np.uint8)
    for i in range(4):
        qh |= (q[..., i, :] >> 4) << (2 * i)
    out[..., 0:128] = ql.reshape(g, 16, p, 2, 128)
    out[..., 128:192] = qh.reshape(g, 16, p, 2, 64)
    return out.reshape(d, ldw)


def dequantize(fmt: str, data: np.ndarray, n: int) -> np.ndarray:
    """Reference NumPy dequantisation of raw rows (r, ...) -> float32 (r, n)."""
    if fmt in X16_BASE:  # (a q6_kx16 row's zero partner super-block cut off)
        base = X16_BASE[fmt]
        return dequantize(base, rows_x16(fmt, data)[:, : row_bytes(base, n)], n)
    r = data.shape[0]
    if fmt == "f32":
        return np.array(data, dtype=np.float32)
    if fmt == "f16":
        return data.view(np.float16).astype(np.float32)
    if fmt == "bf16":
        return (data.astype(np.uint32) << 16).view(np.float32)
    if fmt in _GGUF_REFERENCE:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize as gguf_dequantize

        raw = np.ascontiguousarray(data, dtype=np.uint8).reshape(r, -1)
        out = gguf_dequantize(raw, GGMLQuantizationType[_GGUF_REFERENCE[fmt]])
        return np.asarray(out, dtype=np.float32).reshape(r, n)
    nb = n // QK
    blocks = np.ascontiguousarray(data).reshape(r, nb, BLOCK_BYTES[fmt])
    d = _f16(blocks[:, :, 0:2].copy()).reshape(r, nb, 1)
    if fmt == "q8_0":
        q = blocks[:, :, 2:].view(np.int8).astype(np.float32)
        return (d * q).reshape(r, n)
    off = 2 if fmt == "q4_0" else 4
    qs = blocks[:, :, off : off + 16]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.float32)
    if fmt == "q4_0":
        return (d * (q - 8.0)).reshape(r, n)
    m = _f16(blocks[:, :, 2:4].copy()).reshape(r, nb, 1)
    return (d * q + m).reshape(r, n)


def quantize_q8_0(w: np.ndarray) -> np.ndarray:
    """float32 (d, n) -> q8_0 raw uint8 (d, n/32*34): d = amax / 127, q = rint(x / d).

    llama.cpp's Q8_0 blocks, rounding ties to even; the reference for the C quantiser
    (bit-exact: the same float32 operations in the same order)."""
    d_, n = w.shape
    b = np.asarray(w, dtype=np.float32).reshape(d_, n // QK, QK)
    amax = np.abs(b).max(axis=2, keepdims=True)
    scale = amax / np.float32(127)
    inv = np.where(scale > 0, np.float32(1) / np.where(scale > 0, scale, 1), 0).astype(np.float32)
    q = np.rint(b * inv).astype(np.int8)
    out = np.empty((d_, n // QK, 34), dtype=np.uint8)
    out[:, :, 0:2] = scale.astype(np.float16).view(np.uint8).reshape(d_, n // QK, 2)
    out[:, :, 2:] = q.view(np.uint8)
    return out.reshape(d_, n // QK * 34)


def quantize_q4_0(w: np.ndarray) -> np.ndarray:
    """float32 (d, n) -> q4_0 raw uint8 (d, n/32*18), llama.cpp's Q4_0: mx = the value of
    largest magnitude (the first one), d = mx / -8, q = clamp(rint(x / d) + 8, 0, 15)."""
    d_, n = w.shape
    b = np.asarray(w, dtype=np.float32).reshape(d_, n // QK, QK)
    mx = np.take_along_axis(b, np.abs(b).argmax(axis=2)[..., None], axis=2)
    scale = mx / np.float32(-8)
    inv = np.where(scale != 0, np.float32(1) / np.where(scale != 0, scale, 1), 0).astype(np.float32)
    q = np.clip(np.rint(b * inv) + np.float32(8), 0, 15).astype(np.uint8)
    out = np.empty((d_, n // QK, 18), dtype=np.uint8)
    out[:, :, 0:2] = scale.astype(np.float16).view(np.uint8).reshape(d_, n // QK, 2)
    out[:, :, 2:] = q[:, :, :16] | (q[:, :, 16:] << 4)
    return out.reshape(d_, n // QK * 18)


QUANT_FORMATS = {"q8": "q8_0", "q4": "q4_0"}  # --quant value -> block format
