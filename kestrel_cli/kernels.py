"""The engine's numeric kernels: checked entry points over kestrel_cli._kernels.

The only importer of the compiled Cython kernels. Every function checks dtypes,
contiguity and shapes (ValueError with the offending argument's name), then calls the
kernel. Callers allocate outputs; each function also returns its output array.

`threads` is the number of OpenMP threads; None or 0 means OpenMP's default
(OMP_NUM_THREADS or all cores). The elementwise kernels also drop to fewer threads on
small inputs (one decode token runs single-threaded).
"""
from __future__ import annotations

import numpy as np

from kestrel_cli._kernels import attention as _attention
from kestrel_cli._kernels import matmul as _matmul
from kestrel_cli._kernels import ops as _ops
from kestrel_cli.weights import FORMATS, Weight

# Format codes of pyx/kernels.h (enum KF_*), and the dtype each format's `data` has.
FMT_CODE = {"f32": 0, "f16": 1, "bf16": 2, "q8_0": 3, "q4_0": 4, "q4_1": 5}
_DATA_DTYPE = {"f32": np.float32, "f16": np.uint16, "bf16": np.uint16,
               "q8_0": np.uint8, "q4_0": np.uint8, "q4_1": np.uint8}
assert set(FMT_CODE) == set(FORMATS)


def _threads(threads) -> int:
    if threads is None:
        return 0
    t = int(threads)
    if t < 0:
        raise ValueError(f"threads must be >= 0 (0 = OpenMP default), got {threads}")
    return t


def _array(a, name: str, dtype, ndim: int | None = None, *, writable: bool = False):
    """Check that `a` is a C-contiguous ndarray of `dtype` (and `ndim` dims)."""
    if not isinstance(a, np.ndarray):
        raise ValueError(f"{name}: expected a numpy array, got {type(a).__name__}")
    if a.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {np.dtype(dtype).name}, got {a.dtype}")
    if ndim is not None and a.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim}-D, got shape {a.shape}")
    if not a.flags.c_contiguous:
        raise ValueError(f"{name}: must be C-contiguous (got strides {a.strides})")
    if writable and not a.flags.writeable:
        raise ValueError(f"{name}: must be writable")
    return a


def _shape(a, name: str, shape: tuple) -> None:
    if a.shape != tuple(shape):
        raise ValueError(f"{name}: expected shape {tuple(shape)}, got {a.shape}")


def _rows2d(a, name: str) -> np.ndarray:
    """A C-contiguous (..., n) array as its (R, n) view."""
    if a.ndim < 1:
        raise ValueError(f"{name}: expected at least 1-D, got a scalar")
    return a.reshape(-1, a.shape[-1]) if a.ndim != 2 else a


def _weight_bytes(w) -> np.ndarray:
    """The raw rows of a Weight as uint8 (d, row_bytes), checked."""
    if not isinstance(w, Weight):
        raise ValueError(f"w: expected a kestrel_cli.weights.Weight, got {type(w).__name__}")
    data = _array(w.data, f"w.data ({w.fmt})", _DATA_DTYPE[w.fmt], 2)
    if data.ctypes.data % data.itemsize:
        raise ValueError(f"w.data ({w.fmt}): not aligned to its {data.itemsize}-byte dtype")
    d, n = w.shape
    if data.shape[0] != d:
        raise ValueError(f"w.data: expected {d} rows, got shape {data.shape}")
    return data.view(np.uint8)


def matmul(x: np.ndarray, w: Weight, out: np.ndarray, threads: int | None) -> np.ndarray:
    """out = x @ W.T with W the dequantised weight.

    Args:
        x: float32 (T, n), C-contiguous.
        w: Weight of any format, logical shape (d, n); its data may be a read-only memmap.
        out: float32 (T, d), C-contiguous, written.
        threads: OpenMP threads (None/0: default).
    Returns:
        out.
    """
    raw = _weight_bytes(w)
    d, n = w.shape
    _array(x, "x", np.float32, 2)
    if x.shape[1] != n:
        raise ValueError(f"x: expected (T, {n}) for a weight of shape {w.shape}, got {x.shape}")
    _array(out, "out", np.float32, 2, writable=True)
    _shape(out, "out", (x.shape[0], d))
    _matmul.matmul(x, raw, FMT_CODE[w.fmt], out, _threads(threads))
    return out


def get_rows(w: Weight, ids: np.ndarray, out: np.ndarray) -> np.ndarray:
    """Embedding lookup: out[i] = W[ids[i]] dequantised.

    Args:
        w: Weight (d, n) of any format.
        ids: int64 (m,) row indices in [0, d).
        out: float32 (m, n), written.
    Returns:
        out.
    """
    raw = _weight_bytes(w)
    d, n = w.shape
    _array(ids, "ids", np.int64, 1)
    _array(out, "out", np.float32, 2, writable=True)
    _shape(out, "out", (ids.shape[0], n))
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= d):
        raise ValueError(f"ids: out of range [0, {d}): min {ids.min()}, max {ids.max()}")
    _matmul.get_rows(raw, FMT_CODE[w.fmt], ids, out)
    return out


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, out: np.ndarray,
             threads: int | None = None) -> np.ndarray:
    """RMSNorm over the last axis: out = x / sqrt(mean(x * x) + eps) * weight (float32).

    Args:
        x: float32 (R, n) (or any (..., n)), C-contiguous.
        weight: float32 (n,).
        eps: added to the mean square.
        out: float32, x's shape; may be x itself.
        threads: OpenMP threads (None/0: default).
    Returns:
        out.
    """
    _array(x, "x", np.float32)
    _array(weight, "weight", np.float32, 1)
    _array(out, "out", np.float32, writable=True)
    _shape(out, "out", x.shape)
    x2 = _rows2d(x, "x")
    _shape(weight, "weight", (x2.shape[1],))
    _ops.rms_norm(x2, weight, float(eps), out.reshape(x2.shape), _threads(threads))
    return out


def rope(x: np.ndarray, positions: np.ndarray, inv_freq: np.ndarray, attn_scale: float,
         threads: int | None = None) -> np.ndarray:
    """Rotary embedding in place, HF rotate_half convention.

    For i < half = head_dim / 2: angle = float32(positions[t]) * inv_freq[i] (float32),
    c = cos(angle) * attn_scale, s = sin(angle) * attn_scale,
    (x[i], x[i + half]) = (x[i] * c - x[i + half] * s, x[i + half] * c + x[i] * s).

    Args:
        x: float32 (T, n_heads, head_dim), C-contiguous, rotated in place.
        positions: int64 (T,).
        inv_freq: float32 (head_dim / 2,).
        attn_scale: multiplies cos and sin (HF attention_scaling; 1.0 for plain RoPE).
        threads: OpenMP threads (None/0: default).
    Returns:
        x.
    """
    _array(x, "x", np.float32, 3, writable=True)
    T, _, head_dim = x.shape
    if head_dim % 2:
        raise ValueError(f"x: head_dim must be even, got {head_dim}")
    _array(positions, "positions", np.int64, 1)
    _shape(positions, "positions", (T,))
    _array(inv_freq, "inv_freq", np.float32, 1)
    _shape(inv_freq, "inv_freq", (head_dim // 2,))
    _ops.rope(x, positions, inv_freq, float(attn_scale), _threads(threads))
    return x


def swiglu(gate: np.ndarray, up: np.ndarray, out: np.ndarray,
           threads: int | None = None) -> np.ndarray:
    """out = silu(gate) * up = gate / (1 + exp(-gate)) * up, float32.

    Args:
        gate: float32 (T, I) (or any shape), C-contiguous.
        up: float32, gate's shape.
        out: float32, gate's shape; may be gate or up.
        threads: OpenMP threads (None/0: default).
    Returns:
        out.
    """
    _array(gate, "gate", np.float32)
    _array(up, "up", np.float32)
    _array(out, "out", np.float32, writable=True)
    _shape(up, "up", gate.shape)
    _shape(out, "out", gate.shape)
    g2 = _rows2d(gate, "gate")
    _ops.swiglu(g2, up.reshape(g2.shape), out.reshape(g2.shape), _threads(threads))
    return out


def attention(q: np.ndarray, k_ptrs: np.ndarray, v_ptrs: np.ndarray, kv_bs: int,
              n_kv_heads: int, head_dim: int, pos0: int, scale: float, out: np.ndarray,
              threads: int | None) -> np.ndarray:
    """Causal GQA attention of T query rows over the block KV cache.

    Block b of K (V) is a float32 C-contiguous (kv_bs, n_kv_heads * head_dim) buffer at
    address k_ptrs[b] (v_ptrs[b]); token t is row t % kv_bs of block t // kv_bs. Query row
    i sits at position pos0 + i and attends to tokens 0..pos0+i, which the cache must
    already hold; query head h reads kv head h // (n_heads // n_kv_heads).
    out[i, h] = softmax(scale * q[i, h] . K) @ V, an online softmax in float32.

    Args:
        q: float32 (T, n_heads * head_dim), C-contiguous.
        k_ptrs, v_ptrs: uint64 (n_blocks,) block addresses (`arr.ctypes.data`); the
            caller keeps the blocks alive and correctly shaped.
        kv_bs: tokens per cache block.
        n_kv_heads, head_dim: cache geometry.
        pos0: position of query row 0.
        scale: score scale (usually head_dim ** -0.5).
        out: float32, q's shape, written.
        threads: OpenMP threads (None/0: default).
    Returns:
        out.
    """
    _array(q, "q", np.float32, 2)
    _array(out, "out", np.float32, 2, writable=True)
    _shape(out, "out", q.shape)
    _array(k_ptrs, "k_ptrs", np.uint64, 1)
    _array(v_ptrs, "v_ptrs", np.uint64, 1)
    _shape(v_ptrs, "v_ptrs", k_ptrs.shape)
    kv_bs, n_kv_heads, head_dim, pos0 = int(kv_bs), int(n_kv_heads), int(head_dim), int(pos0)
    if kv_bs < 1 or n_kv_heads < 1 or head_dim < 1 or pos0 < 0:
        raise ValueError(f"attention: bad geometry kv_bs={kv_bs} n_kv_heads={n_kv_heads} "
                         f"head_dim={head_dim} pos0={pos0}")
    T, width = q.shape
    if width % head_dim:
        raise ValueError(f"q: width {width} is not a multiple of head_dim {head_dim}")
    n_heads = width // head_dim
    if n_heads % n_kv_heads:
        raise ValueError(f"attention: n_heads {n_heads} not a multiple of n_kv_heads {n_kv_heads}")
    n_ctx = pos0 + T
    n_used = -(-n_ctx // kv_bs)
    if k_ptrs.shape[0] * kv_bs < n_ctx:
        raise ValueError(f"attention: {k_ptrs.shape[0]} blocks of {kv_bs} tokens cannot hold "
                         f"positions 0..{n_ctx - 1}")
    if T and (not k_ptrs[:n_used].all() or not v_ptrs[:n_used].all()):
        raise ValueError("attention: null block address among the blocks in use")
    _attention.attention(q, k_ptrs, v_ptrs, kv_bs, n_kv_heads, head_dim, pos0, float(scale),
                         out, _threads(threads))
    return out


def scatter_add(out: np.ndarray, src: np.ndarray, rows: np.ndarray, weights: np.ndarray,
                threads: int | None = None) -> np.ndarray:
    """MoE combine: out[rows[m]] += weights[m] * src[m] for every m (in m order).

    Args:
        out: float32 (T, H), updated in place.
        src: float32 (M, H).
        rows: int64 (M,) in [0, T).
        weights: float32 (M,).
        threads: OpenMP threads (None/0: default).
    Returns:
        out.
    """
    _array(out, "out", np.float32, 2, writable=True)
    _array(src, "src", np.float32, 2)
    _array(rows, "rows", np.int64, 1)
    _array(weights, "weights", np.float32, 1)
    M = rows.shape[0]
    _shape(src, "src", (M, out.shape[1]))
    _shape(weights, "weights", (M,))
    if M and (int(rows.min()) < 0 or int(rows.max()) >= out.shape[0]):
        raise ValueError(f"rows: out of range [0, {out.shape[0]}): min {rows.min()}, "
                         f"max {rows.max()}")
    _ops.scatter_add(out, src, rows, weights, _threads(threads))
    return out
