"""K-quant quantisers (GGUF's Q4_K, Q5_K, Q6_K) in vectorised NumPy, for `kestrel quantize`.

The gguf package dequantises K-quants but cannot quantise them. These follow llama.cpp's
reference quantisers (ggml-quants.c: quantize_row_q{4,5,6}_K_ref, what llama-quantize runs
without an importance matrix): the same search for each sub-block's scale (and min), the
same 6-bit (Q4_K/Q5_K) or 8-bit (Q6_K) scales relative to one f16 scale per super-block of
256, the same rounding (to nearest, ties to even) and the same bit layout, in float32, with
every sum taken in the C loop's order (the sub-blocks lie along axis 1, the 32 or 16 values
of each along axis 0, which NumPy reduces one after the other), so the bytes match
llama.cpp's (checked against its library on random, heavy-tailed, bf16-rounded, constant
and tiny data).

Block layouts (bytes; one block = 256 values of a row):
  Q4_K  144: f16 d, f16 dmin, 12 bytes of 8 x (6-bit scale, 6-bit min), 128 bytes of 4-bit q;
             x = d*sc_j*q - dmin*m_j for sub-block j of 32
  Q5_K  176: as Q4_K, with 32 bytes of fifth bits (bit j of byte l: element 32j+l) before qs
  Q6_K  210: 128 bytes of low 4 bits, 64 of high 2 bits, 16 int8 scales (sub-blocks of 16),
             f16 d; x = d*sc_j*(q - 32)
"""

from __future__ import annotations

import numpy as np

QK_K = 256
BLOCK_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}
_EPS = np.float32(1e-15)  # llama.cpp's GROUP_MAX_EPS
_F = np.float32


def _f16(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(float16 bits as uint8 pairs, the float32 value they hold)."""
    h = x.astype(np.float16)
    return h.view(np.uint8).reshape(*x.shape, 2), h.astype(np.float32)


def _min_scale_search(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """llama.cpp's make_qkx2_quants on each column of x (32, n): x ~ scale*L - the_min with
    L in 0..nmax, chosen by weighted least squares over nstep+1 trial scales. The sums run
    over axis 0, element after element, as the C loop adds them; the big temporaries are
    reused (out=), the arithmetic is the C code's, operation for operation.
    Returns (scale (n,), the_min (n,), L (32, n) uint8)."""
    w = np.sqrt((x * x).sum(axis=0) / _F(32)) + np.abs(x)
    mn = np.minimum(x.min(axis=0), _F(0))
    mx = x.max(axis=0)
    sum_w = w.sum(axis=0)
    sum_x = (w * x).sum(axis=0)
    flat = mx == mn
    la, t1, t2 = np.empty_like(x), np.empty_like(x), np.empty_like(x)

    def quants(iscale, out):
        """clip(rint(iscale * (x - mn)), 0, nmax) into `out`."""
        np.subtract(x, mn, out=out)
        np.multiply(iscale, out, out=out)
        np.rint(out, out=out)
        return np.clip(out, 0, nmax, out=out)

    def error(scale, lv, m):
        """sum(w * (scale*lv + m - x)^2) over axis 0."""
        np.multiply(scale, lv, out=t1)
        np.add(t1, m, out=t1)
        np.subtract(t1, x, out=t1)
        np.multiply(t1, t1, out=t1)
        np.multiply(w, t1, out=t1)
        return t1.sum(axis=0)

    with np.errstate(divide="ignore", invalid="ignore"):
        rng = np.where(flat, _F(1), mx - mn)
        iscale = _F(nmax) / rng
        scale = _F(1) / iscale
        L = quants(iscale, np.empty_like(x))
        best = error(scale, L, mn)
        for i in range(nstep + 1):
            rng = np.where(flat, _F(1), mx - mn)  # the C loop moves min as it goes
            iscale = (_F(rmin) + _F(rdelta) * _F(i) + _F(nmax)) / rng
            quants(iscale, la)
            np.multiply(w, la, out=t2)  # w*l
            sum_l = t2.sum(axis=0)
            sum_l2 = np.multiply(t2, la, out=t1).sum(axis=0)
            sum_xl = np.multiply(t2, x, out=t1).sum(axis=0)
            D = sum_w * sum_l2 - sum_l * sum_l
            this_scale = (sum_w * sum_xl - sum_x * sum_l) / D
            this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D
            pos = this_min > 0
            this_scale = np.where(pos, sum_xl / sum_l2, this_scale)
            this_min = np.where(pos, _F(0), this_min)
            cur = error(this_scale, la, this_min)
            better = (D > 0) & (cur < best) & ~flat
            if better.any():
                np.copyto(L, la, where=better)
                best = np.where(better, cur, best)
                scale = np.where(better, this_scale, scale)
                mn = np.where(better, this_min, mn)
    scale = np.where(flat, _F(0), scale).astype(np.float32)
    L[:, flat] = 0
    return scale, (-mn).astype(np.float32), L.astype(np.uint8)


def _scale_min_blocks(x: np.ndarray, nmax: int, rmin: float, rdelta: float, nstep: int):
    """The shared part of Q4_K and Q5_K: (d bytes, dmin bytes, 12 scale bytes, L (nb, 8, 32))."""
    nb = x.shape[0]
    sub = np.ascontiguousarray(x.reshape(nb * 8, 32).T)  # (32, sub-blocks)
    scales, mins, L = _min_scale_search(sub, nmax, rmin, rdelta, nstep)
    scales, mins, L = scales.reshape(nb, 8), mins.reshape(nb, 8), L.T.reshape(nb, 8, 32)
    max_scale = np.maximum(scales.max(axis=1), _F(0))
    max_min = np.maximum(mins.max(axis=1), _F(0))
    with np.errstate(divide="ignore"):
        inv_scale = np.where(max_scale > 0, _F(63) / max_scale, _F(0))
        inv_min = np.where(max_min > 0, _F(63) / max_min, _F(0))
    ls = np.clip(np.rint(inv_scale[:, None] * scales), 0, 63).astype(np.uint8)
    lm = np.clip(np.rint(inv_min[:, None] * mins), 0, 63).astype(np.uint8)
    d_bytes, d = _f16(max_scale / _F(63))
    m_bytes, dmin = _f16(max_min / _F(63))
    sc = np.empty((nb, 12), np.uint8)
    sc[:, 0:4] = ls[:, :4] | ((ls[:, 4:] >> 4) << 6)
    sc[:, 4:8] = lm[:, :4] | ((lm[:, 4:] >> 4) << 6)
    sc[:, 8:12] = (ls[:, 4:] & 0xF) | ((lm[:, 4:] & 0xF) << 4)
    dj = (d[:, None] * ls.astype(np.float32))[:, :, None]
    dm = (dmin[:, None] * lm.astype(np.float32))[:, :, None]
    xs = x.reshape(nb, 8, 32)
    with np.errstate(divide="ignore", invalid="ignore"):
        requant = np.clip(np.rint((xs + dm) / dj), 0, nmax)
    L = np.where(dj != 0, requant, L).astype(np.uint8)
    return d_bytes, m_bytes, sc, L


def _pack_nibbles(L: np.ndarray) -> np.ndarray:
    """(nb, 8, 32) values 0..15 -> (nb, 128): byte l of pair p holds sub-block 2p (low
    nibble) and 2p+1 (high nibble)."""
    nb = L.shape[0]
    L = L.reshape(nb, 4, 2, 32)
    return (L[:, :, 0] | (L[:, :, 1] << 4)).reshape(nb, 128)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """float32 (r, n), n a multiple of 256 -> Q4_K bytes (r, n/256*144)."""
    r, n = x.shape
    xb = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, QK_K)
    d, dmin, sc, L = _scale_min_blocks(xb, 15, -1.0, 0.1, 20)
    out = np.concatenate([d, dmin, sc, _pack_nibbles(L)], axis=1)
    return out.reshape(r, n // QK_K * 144)


def quantize_q5_k(x: np.ndarray) -> np.ndarray:
    """float32 (r, n), n a multiple of 256 -> Q5_K bytes (r, n/256*176)."""
    r, n = x.shape
    xb = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, QK_K)
    d, dmin, sc, L = _scale_min_blocks(xb, 31, -0.5, 0.1, 15)
    hi = (L >> 4) & 1  # (nb, 8, 32)
    qh = np.zeros((L.shape[0], 32), np.uint8)
    for j in range(8):
        qh |= hi[:, j] << j
    out = np.concatenate([d, dmin, sc, qh, _pack_nibbles(L & 0xF)], axis=1)
    return out.reshape(r, n // QK_K * 176)


def _signed_scale_search(x: np.ndarray, nmax: int):
    """llama.cpp's make_qx_quants (weights x^2) on each column of x (16, n): x ~
    scale*(L - nmax), L in 0..2*nmax-1, the best of 19 trial scales (sums over axis 0, in
    the C loop's order). Returns (scale (n,), L (16, n) uint8)."""
    idx = np.abs(x).argmax(axis=0)  # the first of the largest magnitude
    mx = np.take_along_axis(x, idx[None, :], axis=0)[0]
    zero = np.abs(mx) < _EPS
    mx = np.where(zero, _F(1), mx)
    w = x * x
    wx = w * x
    lv, t = np.empty_like(x), np.empty_like(x)

    def trial(iscale, out):
        np.multiply(iscale, x, out=out)
        np.rint(out, out=out)
        np.clip(out, -nmax, nmax - 1, out=out)
        sumlx = np.multiply(wx, out, out=t).sum(axis=0)
        np.multiply(w, out, out=t)
        return sumlx, np.multiply(t, out, out=t).sum(axis=0)

    L = np.empty_like(x)
    sumlx, suml2 = trial(_F(-nmax) / mx, L)
    with np.errstate(divide="ignore", invalid="ignore"):
        scale = np.where(suml2 != 0, sumlx / suml2, _F(0))
        best = scale * sumlx
        for i in range(-9, 10):
            if i == 0:
                continue
            sumlx, suml2 = trial(-(_F(nmax) + _F(0.1) * _F(i)) / mx, lv)
            better = (suml2 > 0) & (sumlx * sumlx > best * suml2)
            if better.any():
                np.copyto(L, lv, where=better)
                scale = np.where(better, sumlx / suml2, scale)
                best = np.where(better, scale * sumlx, best)
    scale = np.where(zero, _F(0), scale).astype(np.float32)
    L += nmax
    L[:, zero] = 0
    return scale, L.astype(np.uint8)


def quantize_q6_k(x: np.ndarray) -> np.ndarray:
    """float32 (r, n), n a multiple of 256 -> Q6_K bytes (r, n/256*210)."""
    r, n = x.shape
    xb = np.ascontiguousarray(x, dtype=np.float32).reshape(-1, QK_K)
    nb = xb.shape[0]
    scales, L = _signed_scale_search(np.ascontiguousarray(xb.reshape(nb * 16, 16).T), 32)
    scales, L = scales.reshape(nb, 16), L.T.reshape(nb, 16, 16)
    idx = np.abs(scales).argmax(axis=1)
    max_scale = np.take_along_axis(scales, idx[:, None], axis=1)[:, 0]
    zero = np.abs(max_scale) < _EPS
    with np.errstate(divide="ignore", invalid="ignore"):
        iscale = np.where(zero, _F(0), _F(-128) / np.where(zero, _F(1), max_scale))
        d_bytes, d = _f16(np.where(zero, _F(0), _F(1) / np.where(zero, _F(1), iscale)))
        sc = np.minimum(np.rint(iscale[:, None] * scales), 127).astype(np.int8)
        dj = (d[:, None] * sc.astype(np.float32))[:, :, None]
        requant = np.clip(np.rint(xb.reshape(nb, 16, 16) / dj), -32, 31) + 32
    L = np.where(dj != 0, requant, L).astype(np.uint8).reshape(nb, 2, 4, 32)
    L = np.where(zero[:, None, None, None], 0, L).astype(np.uint8)
    sc = np.where(zero[:, None], 0, sc).astype(np.int8)
    lo = L & 0xF
    ql = np.concatenate(
        [lo[:, :, 0] | (lo[:, :, 2] << 4), lo[:, :, 1] | (lo[:, :, 3] << 4)], axis=2
    ).reshape(nb, 128)
    hi = L >> 4
    qh = (hi[:, :, 0] | (hi[:, :, 1] << 2) | (hi[:, :, 2] << 4) | (hi[:, :, 3] << 6)).reshape(
        nb, 64
    )
    out = np.concatenate([ql, qh, sc.view(np.uint8), d_bytes], axis=1)
    return out.reshape(r, n // QK_K * 210)


QUANTIZERS = {"q4_k": quantize_q4_k, "q5_k": quantize_q5_k, "q6_k": quantize_q6_k}
