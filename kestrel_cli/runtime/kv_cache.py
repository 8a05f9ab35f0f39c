"""The KV cache: it stores K and V and it attends (docs/DESIGN.md §2 KV cache layout).

Layer l, token t: K at `k_blocks[l][t // KV_BLOCK]`, row t % KV_BLOCK, a row of
n_kv_heads*head_dim values (head h at columns h*head_dim...). Blocks are allocated as the
sequence grows; kernels get them as a table of addresses (`k_ptrs[l]`, uint64), so no
block is ever moved or copied once written.

float32 cache: a block is float32 (KV_BLOCK, kv_dim). int8 cache (spec dtype "q8"): a
block is one byte buffer, the int8 values (KV_BLOCK, kv_dim) in the same places, then at
byte `scale_offset` (64-byte aligned) the float32 scales (n_kv_heads, KV_BLOCK), one per
(token, kv head), symmetric: scale = max|x| / 127, x ~ scale * q; the kernels define this layout
(`kernels.kv_q8_layout`). float16 cache (dtype "f16"): a block is IEEE half
(KV_BLOCK, kv_dim), values rounded to nearest even (numpy's astype(float16)).

A `CacheSpec` says what the cache is: value type, and how attention reads it (exact, or
block-sparse as its `SparseSpec` says, docs/DESIGN.md §3 Sparse selection).
The model writes a layer's new K, V (`write`) and asks for its attention (`attend`); which
kernel entry runs (one decode row or a prefill block), the sparse settings, the decode
scratch and the importance bookkeeping are the cache's. Per layer, `importance` (float32
(n_layers, max_tokens)) is the prefill attention mass each token received, which every
prefill call (T > 1) adds to; decode steps add nothing, so tokens after the prompt keep 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.runtime import kernels as K
from kestrel_cli.runtime.kernels import KV_BLOCK
from kestrel_cli.runtime.sparse import SparseSpec, importance_order

DTYPES = ("f32", "q8", "f16")


@dataclass(frozen=True)
class CacheSpec:
    """What a KV cache is: its value type and how attention reads it.

    Args:
        dtype: "f32" (float32 values), "q8" (int8 values, a float32 scale per token and
            kv head) or "f16" (IEEE half values).
        sparse: block-sparse attention with these options (`sparse.SparseSpec`); None
            (or k == 0): exact attention.
    """

    dtype: str = "f32"
    sparse: SparseSpec | None = None
    block: ClassVar[int] = KV_BLOCK  # tokens per block (not a choice)

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise KestrelError(
                f"KV cache dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}"
            )
        if self.sparse is not None and not isinstance(self.sparse, SparseSpec):
            raise KestrelError(
                f"CacheSpec.sparse must be a SparseSpec or None, got {type(self.sparse).__name__}"
            )
        if self.sparse is not None and self.sparse.k == 0:
            object.__setattr__(self, "sparse", None)

    @property
    def sparse_k(self) -> int:
        """Blocks per query head; 0: exact attention."""
        return self.sparse.k if self.sparse else 0

    @property
    def sparse_width(self) -> int:
        """Most blocks a sparse query attends to (`SparseSpec.width`); 0 when exact."""
        return self.sparse.width if self.sparse else 0


class BlockPool:
    """The memory of a cache's blocks (`nbytes` each, 64-byte aligned): carved in order from
    chunks of `kernels.huge_buffer` memory, private anonymous mappings on transparent huge
    pages, each touched only as its blocks are written; blocks given back (a trim) are
    handed out again first. A sparse decode step reads a few rows of blocks all over
    the cache: on 4 KiB pages nearly every one is a TLB miss, which huge pages avoid
    (`scripts/attn_bench.py -k 32` shows the step's time). A chunk's memory is unmapped once none
    of its blocks is referenced (the arrays hold the mapping)."""

    CHUNK = 64 << 20  # bytes a chunk maps (virtual; resident as its blocks are written)

    def __init__(self, nbytes: int, total: int):
        """nbytes: one block's bytes; total: most blocks the cache will hold (the first
        chunk is no larger than they need)."""
        self.nbytes, self.stride = nbytes, -(-nbytes // 64) * 64
        self.total = max(1, total)
        self._chunk: np.ndarray | None = None
        self._used = 0  # bytes of _chunk handed out
        self._free: list[np.ndarray] = []

    def take(self) -> np.ndarray:
        """A block: uint8 (nbytes,), contents undefined."""
        if self._free:
            return self._free.pop()
        if self._chunk is None or self._used + self.stride > self._chunk.size:
            self._chunk = K.huge_buffer(
                max(1, min(self.CHUNK // self.stride, self.total)) * self.stride
            )
            self._used = 0
        b = self._chunk[self._used : self._used + self.nbytes]
        self._used += self.stride
        return b

    def give(self, blocks: list[np.ndarray]) -> None:
        """Blocks the cache no longer holds, for the next take()s."""
        self._free.extend(blocks)


class KVCache:
    """K and V of one sequence, every layer, and attention over them.

    Args:
        n_layers, n_kv_heads, head_dim: the model's geometry.
        max_tokens: the context size (tokens the cache may hold).
        spec: what the cache is (default: float32, exact).
        threads: OpenMP threads of its kernels (None/0: default).
    """

    def __init__(
        self,
        n_layers: int,
        n_kv_heads: int,
        head_dim: int,
        max_tokens: int,
        spec: CacheSpec = CacheSpec(),
        threads: int | None = None,
    ):
        self.n_layers, self.max_tokens, self.spec = n_layers, max_tokens, spec
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.kv_dim = n_kv_heads * head_dim
        self.kv_bs = KV_BLOCK
        self.scale = 1.0 / math.sqrt(head_dim)  # softmax(q . k * scale)
        # read on every attend: plain attributes, not spec lookups
        self.q8 = spec.dtype == "q8"
        self.f16 = spec.dtype == "f16"
        self.kv_kind = K.kv_kind(self.q8, self.f16)
        sp = spec.sparse
        self.sparse_k, self.sparse_probes = spec.sparse_k, sp.probes if sp else 8
        self.threads = int(threads or 0)  # 0: OpenMP default
        if self.q8:
            self.scale_offset, self.block_bytes = K.kv_q8_layout(KV_BLOCK, n_kv_heads, head_dim)
        else:
            self.scale_offset = 0
            self.block_bytes = KV_BLOCK * self.kv_dim * (2 if self.f16 else 4)
        cap = -(-max_tokens // KV_BLOCK)
        self._pool = BlockPool(self.block_bytes, 2 * n_layers * cap)
        self.k_blocks: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
        self.v_blocks: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
        self.k_ptrs = np.zeros((n_layers, cap), dtype=np.uint64)  # block addresses
        self.v_ptrs = np.zeros((n_layers, cap), dtype=np.uint64)
        self.offset = 0  # tokens committed
        # np.zeros maps pages lazily: memory is only touched for the tokens in use
        self.importance = np.zeros((n_layers, max_tokens), dtype=np.float32)
        self._has_imp = np.zeros(n_layers, dtype=bool)  # some prefill recorded here
        self._imp_end = 0  # tokens importance may cover
        self._order: list[np.ndarray | None] = [None] * n_layers  # importance_order cache
        self._native = None  # decode_attention's per-layer tables (None: stale)
        self._slots: np.ndarray | None = None  # (SLOTS, max_tokens) scratch
        self._dec_tab: np.ndarray | None = None  # decode scratch (kernels.attention)
        self.record_selection = False  # tests: keep each layer's last sparse picks
        self.selection: list[np.ndarray | None] = [None] * n_layers
        dense = sp.dense if sp else ()
        bad = [x for x in dense if x >= n_layers]
        if bad:
            raise KestrelError(
                f"dense layers {bad} out of range: the model has {n_layers} "
                f"layers (0..{n_layers - 1})"
            )
        self.dense = frozenset(dense)
        # bound probe: per layer, kv head and block the max then min of K (int8 with an
        # int8 cache, float32 otherwise), kept up to date by write(); sketch probe, in the
        # same arrays: per layer, kv head and token the key and the value at 4 bits (uint8
        # (n_kv, 2, cap, head_dim // 2, KV_BLOCK): a kv head's blocks' key rows, then their
        # value rows, dimension-major) and their scales (float32 (n_kv, cap, 2 * KV_BLOCK))
        self.sketch = sp is not None and sp.probe == "sketch"
        self.sparse_opts, self.sparse_width = self._opts(spec), spec.sparse_width
        self.bounds = self.bound_scales = None
        self._bcap = cap
        self._use_bounds = False  # attend reads the bounds
        self._bnd: list = [None] * n_layers  # per layer: flat uint8 view
        self._bsc: list = [None] * n_layers  # per layer: flat float32 scales
        if sp is not None and sp.probe == "bound":
            if head_dim > K.HD_MAX:
                raise KestrelError(f"the bound probe needs head_dim <= {K.HD_MAX}")
            self.bounds = np.zeros(
                (n_layers, n_kv_heads, cap, 2, head_dim), np.int8 if self.q8 else np.float32
            )
            self.bound_scales = np.zeros((n_layers, n_kv_heads, cap), np.float32)
            for layer in range(n_layers):
                self._bnd[layer] = self.bounds[layer].reshape(-1).view(np.uint8)
                self._bsc[layer] = self.bound_scales[layer].reshape(-1)
            self._use_bounds = True
        if self.sketch:
            if head_dim % 2 or head_dim > K.SKETCH_HD_MAX:
                raise KestrelError(
                    f"the sketch probe needs an even head_dim <= {K.SKETCH_HD_MAX}, got {head_dim}"
                )
            self.bounds = np.zeros(
                (n_layers, n_kv_heads, 2, cap, head_dim // 2, KV_BLOCK), np.uint8
            )
            self.bound_scales = np.zeros((n_layers, n_kv_heads, cap, 2 * KV_BLOCK), np.float32)
            for layer in range(n_layers):
                self._bnd[layer] = self.bounds[layer].reshape(-1)
                self._bsc[layer] = self.bound_scales[layer].reshape(-1)
            self._use_bounds = True

    def _opts(self, spec: CacheSpec) -> K.SparseOpts:
        """The kernel's sparse options (filled once per spec): the spec's, and whether the
        bounds arrays hold key sketches (the writes keep them whatever probe reads)."""
        if spec.sparse is None:
            return K.SparseOpts(sketch=self.sketch)
        return spec.sparse.kernel_opts(self.sketch)

    @property
    def n_blocks(self) -> int:
        return len(self.k_blocks[0]) if self.n_layers else 0

    def _new_block(self) -> np.ndarray:
        b = self._pool.take()
        if self.q8:
            return b
        return b.view(np.float16 if self.f16 else np.float32).reshape(KV_BLOCK, self.kv_dim)

    def _q8_views(self, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values int8 (KV_BLOCK, kv_dim), scales float32 (n_kv_heads, KV_BLOCK)) of an
        int8 block."""
        vals = block[: KV_BLOCK * self.kv_dim].view(np.int8).reshape(KV_BLOCK, self.kv_dim)
        scales = block[self.scale_offset : self.block_bytes]
        return vals, scales.view(np.float32).reshape(self.n_kv_heads, KV_BLOCK)

    def reserve(self, n_new: int) -> None:
        """Make room for `n_new` more tokens on every layer (allocating whole blocks)."""
        need = self.offset + n_new
        if need > self.max_tokens:
            raise KestrelError(
                f"context full: {need} tokens exceed the context size {self.max_tokens}"
            )
        want = -(-need // KV_BLOCK)
        for layer in range(self.n_layers):
            for blocks, ptrs in (
                (self.k_blocks[layer], self.k_ptrs[layer]),
                (self.v_blocks[layer], self.v_ptrs[layer]),
            ):
                while len(blocks) < want:
                    b = self._new_block()
                    ptrs[len(blocks)] = b.ctypes.data
                    blocks.append(b)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store K and V (T, kv_dim) of tokens offset..offset+T-1 (reserve() first)."""
        t, n = self.offset, k.shape[0]
        if self.q8:
            k, v = np.ascontiguousarray(k, np.float32), np.ascontiguousarray(v, np.float32)
        done = 0
        while done < n:
            b, r = divmod(t + done, KV_BLOCK)
            m = min(n - done, KV_BLOCK - r)
            if self.q8:
                for src, blocks in ((k, self.k_blocks), (v, self.v_blocks)):
                    vals, scales = self._q8_views(blocks[layer][b])
                    K.quantize_q8(
                        src[done : done + m],
                        self.head_dim,
                        vals[r : r + m],
                        scales[:, r : r + m].T,
                        self.threads,
                    )
            else:  # float16: numpy rounds to nearest even, |x| > 65504 becomes inf
                with np.errstate(over="ignore"):
                    self.k_blocks[layer][b][r : r + m] = k[done : done + m]
                    self.v_blocks[layer][b][r : r + m] = v[done : done + m]
            if self.bounds is not None:
                self._update_bounds(layer, b, r, r + m)
            done += m

    def _update_bounds(self, layer: int, b: int, r0: int, r1: int) -> None:
        """Fold rows r0..r1-1 of K block b of `layer` into its key bounds (or sketch)."""
        if self.sketch:
            K.sketch_update_unchecked(
                int(self.k_ptrs[layer, b]),
                int(self.v_ptrs[layer, b]),
                self.kv_kind,
                self.n_kv_heads,
                self.head_dim,
                r0,
                r1,
                self._bnd[layer],
                self._bsc[layer],
                self._bcap,
                b,
            )
            return
        K.bounds_update_unchecked(
            int(self.k_ptrs[layer, b]),
            self.kv_kind,
            self.n_kv_heads,
            self.head_dim,
            r0,
            r1,
            self._bnd[layer],
            self._bsc[layer],
            self._bcap,
            b,
        )

    def views(self, layer: int, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Block address tables covering the first `n_tokens` tokens of `layer`."""
        nb = -(-n_tokens // KV_BLOCK)
        return self.k_ptrs[layer, :nb], self.v_ptrs[layer, :nb]

    def attend(self, layer: int, q: np.ndarray, out: np.ndarray) -> np.ndarray:
        """Causal attention of T query rows at positions offset..offset+T-1 over the
        tokens 0..offset+T-1 of `layer` (`write` them first): exact or block-sparse, over
        float32, int8 or float16 K and V, as the spec says. A prefill block (T > 1) also records
        the attention mass each token receives (`importance`).

        Args:
            q: float32 (T, n_heads * head_dim), C-contiguous, rotated.
            out: float32, q's shape, written.
        Returns:
            out.
        """
        T, pos0 = q.shape[0], self.offset
        k_ptrs, v_ptrs = self.views(layer, pos0 + T)
        order = sel = None
        k = self.sparse_k
        sp = self.spec.sparse
        if k and (layer in self.dense or (T > 1 and not sp.sparse_prefill)):
            k = 0  # dense layer, or exact prefill
        if k:
            if self._has_imp[layer] and sp.importance:  # what the prefill
                # calls before this one recorded
                order = self._order[layer]
                if order is None:  # recomputed after each prefill or trim
                    order = self._order[layer] = importance_order(
                        self.importance[layer], self.max_tokens, KV_BLOCK
                    )
            if self.record_selection:
                sel = np.full((T, q.shape[1] // self.head_dim, self.sparse_width), -1, np.int32)
                self.selection[layer] = sel
        if T == 1:  # decode: the per-token path, nothing allocated
            return K.attention_unchecked(
                q,
                k_ptrs,
                v_ptrs,
                KV_BLOCK,
                self.n_kv_heads,
                self.head_dim,
                pos0,
                self.scale,
                out,
                self.threads,
                self.kv_kind,
                k,
                self.sparse_opts,
                order,
                sel,
                self._decode_tab(q.shape[1] // self.head_dim),
                self._bnd[layer] if self._use_bounds else None,
                self._bsc[layer],
                self._bcap,
            )
        if self._slots is None:
            self._slots = np.zeros((K.SLOTS, self.max_tokens), dtype=np.float32)
        K.attention(
            q,
            k_ptrs,
            v_ptrs,
            KV_BLOCK,
            self.n_kv_heads,
            self.head_dim,
            pos0,
            self.scale,
            out,
            self.threads,
            kv_q8=self.q8,
            kv_f16=self.f16,
            sparse_k=k,
            sparse=self.sparse_opts,
            imp_order=order,
            importance=self.importance[layer],
            imp_slots=self._slots,
            sel=sel,
            bounds=self.bounds[layer] if self._use_bounds else None,
            bound_scales=self.bound_scales[layer] if self._use_bounds else None,
            bound_cap=self._bcap,
            imp_from=pos0 + T - sp.window if sp and sp.window else 0,
        )
        self._imp_end = max(self._imp_end, pos0 + T)
        self._has_imp[layer] = True
        self._order[layer] = None
        self._native = None
        return out

    rows_only = False  # as CacheRows': a plain cache's layer runs its own norms and RoPE

    @property
    def rows_batchable(self) -> bool:
        """Whether a decode row of this cache may run in CacheRows' one kernel call a layer
        (kernels.attention_rows): exact attention, no key bounds or sketches to keep up,
        no selections recorded."""
        return self.spec.sparse is None and self.bounds is None and not self.record_selection

    def write_attend(
        self, layer: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, out: np.ndarray
    ) -> np.ndarray:
        """`write` k, v, then `attend` q into out (CacheRows' per-layer call, for one cache)."""
        self.write(layer, k, v)
        return self.attend(layer, q, out)

    def _decode_tab(self, n_heads: int) -> np.ndarray:
        """The decode kernels' scratch, made once at the context's size."""
        if self._dec_tab is None:
            self._dec_tab = np.empty(
                K.decode_tab_size(self.max_tokens, n_heads, self.head_dim, KV_BLOCK),
                dtype=np.float32,
            )
        return self._dec_tab

    def decode_attention(self, n_heads: int) -> K.DecodeAttention:
        """This cache's tables for one decode token at row `offset` (the model's
        kernels.DecodeStack writes its K and V there and attends as `write` + `attend` would;
        not committed: commit(1) after). n_heads: the model's query heads (the scratch)."""
        t = self._native
        if t is None:  # per-layer tables, rebuilt after a prefill or trim
            L = self.n_layers
            ks = np.array(
                [0 if layer in self.dense else self.sparse_k for layer in range(L)], np.int32
            )
            orders, n_orders = np.zeros(L, np.uint64), np.zeros(L, np.int64)
            for layer in range(L):
                if ks[layer] and self._has_imp[layer] and self.spec.sparse.importance:
                    order = self._order[layer]
                    if order is None:
                        order = self._order[layer] = importance_order(
                            self.importance[layer], self.max_tokens, KV_BLOCK
                        )
                    orders[layer], n_orders[layer] = order.ctypes.data, order.shape[0]
            bnds, bscs = np.zeros(L, np.uint64), np.zeros(L, np.uint64)
            if self.bounds is not None:
                for layer in range(L):
                    bnds[layer] = self._bnd[layer].ctypes.data
                    bscs[layer] = self._bsc[layer].ctypes.data
            t = self._native = (ks, orders, n_orders, bnds, bscs)
        ks, orders, n_orders, bnds, bscs = t
        return K.DecodeAttention(
            self.offset,
            self.k_ptrs,
            self.v_ptrs,
            KV_BLOCK,
            self.kv_kind,
            self.scale_offset,
            self.scale,
            self.threads,
            ks,
            orders,
            n_orders,
            self.sparse_opts,
            bnds,
            bscs,
            self._bcap,
            self._use_bounds,
            self._decode_tab(n_heads),
        )

    def respec(self, spec: CacheSpec) -> None:
        """Read this cache's contents from now on with another spec's attention settings
        (sparse_k and the selection options): the value type must be the same, and the
        bound probe needs a cache made with it (its bounds are kept from the first write).
        scripts/sparse_eval.py compares settings over one prefill this way."""
        if spec.dtype != self.spec.dtype:
            raise KestrelError(f"respec: the cache holds {self.spec.dtype}, not {spec.dtype}")
        sp = spec.sparse
        if (
            sp is not None
            and sp.probe in ("bound", "sketch")
            and (self.bounds is None or self.sketch != (sp.probe == "sketch"))
        ):
            raise KestrelError(f"respec: the {sp.probe} probe needs a cache made with it")
        dense = sp.dense if sp else ()
        bad = [x for x in dense if x >= self.n_layers]
        if bad:
            raise KestrelError(
                f"dense layers {bad} out of range: the model has {self.n_layers} layers"
            )
        self.spec = spec
        self.sparse_k, self.sparse_probes = spec.sparse_k, sp.probes if sp else 8
        self.dense = frozenset(dense)
        self.sparse_opts, self.sparse_width = self._opts(spec), spec.sparse_width
        self._use_bounds = sp is not None and sp.probe in ("bound", "sketch")
        self._native = None

    def commit(self, n: int) -> None:
        self.offset += n

    def trim(self, n: int) -> None:
        """Keep the first `n` tokens; blocks past them are freed, their importance cleared."""
        self.offset = min(n, self.offset)
        keep = -(-self.offset // KV_BLOCK)
        if keep == 0:  # all of it: the memory goes back to the system
            self._pool = BlockPool(self.block_bytes, self._pool.total)
        for layer in range(self.n_layers):
            if keep:
                self._pool.give(self.k_blocks[layer][keep:] + self.v_blocks[layer][keep:])
            del self.k_blocks[layer][keep:]
            del self.v_blocks[layer][keep:]
            self.k_ptrs[layer, keep:] = 0
            self.v_ptrs[layer, keep:] = 0
        if self.bounds is not None and not self.sketch and self.offset % KV_BLOCK:
            for layer in range(self.n_layers):  # the kept rows of the last block only
                # (a bound folds rows together; a sketch's rows are independent)
                self._update_bounds(layer, keep - 1, 0, self.offset % KV_BLOCK)
        self.importance[:, self.offset : self._imp_end] = 0
        self._imp_end = self.offset
        self._order = [None] * self.n_layers
        self._native = None
        if self.offset == 0:
            self._has_imp[:] = False

    def reset(self) -> None:
        self.trim(0)

    @property
    def nbytes(self) -> int:
        """Bytes of KV held for the committed tokens (whole blocks; int8 values + scales)."""
        return sum(b.nbytes for blocks in self.k_blocks + self.v_blocks for b in blocks)

    def _gather(self, blocks: list[np.ndarray]) -> np.ndarray:
        if not self.offset:
            return np.zeros((0, self.kv_dim), np.float32)
        if not self.q8:
            return np.concatenate(blocks)[: self.offset].astype(np.float32)
        rows = []
        for i, b in enumerate(blocks):
            n = min(KV_BLOCK, self.offset - i * KV_BLOCK)  # rows written
            if n <= 0:
                break
            vals, scales = self._q8_views(b)
            rows.append(
                (
                    vals[:n].reshape(n, self.n_kv_heads, self.head_dim) * scales.T[:n, :, None]
                ).reshape(n, self.kv_dim)
            )
        return np.concatenate(rows).astype(np.float32)

    def keys(self, layer: int) -> np.ndarray:
        """K of the committed tokens as one float32 (offset, kv_dim) array, dequantised
        from an int8 cache or widened from a float16 one (tests and the sparse reference; not used by the engine)."""
        return self._gather(self.k_blocks[layer])

    def values(self, layer: int) -> np.ndarray:
        """V of the committed tokens, as `keys`."""
        return self._gather(self.v_blocks[layer])


class CacheRows:
    """Several KV caches as one to a model's layers (Model.forward_rows): rows a..b of a
    pass's K, V and Q belong to the sequence of `cache`, for each (cache, a, b) of spans;
    each writes to and attends over its own cache (reserve() them first, commit() after
    the pass: the offsets are read here, once).

    The one-token spans of caches that `rows_batchable` allows, of the first such span's
    value type, write and attend in one kernel call a layer (kernels.attention_rows, the
    bits of each cache's own `attend`); the other spans (prompt chunks, sparse caches,
    bounds or sketches to keep) run through their caches one by one."""

    record_selection = False

    def __init__(self, spans: list[tuple["KVCache", int, int]]):
        self.spans = spans
        one = [i for i, (c, a, b) in enumerate(spans) if b - a == 1 and c.rows_batchable]
        if one:  # one call: one value type and geometry (a model's caches share the latter)

            def kind(c: KVCache) -> tuple:
                return c.kv_kind, c.n_kv_heads, c.head_dim, c.scale, c.threads

            first = kind(spans[one[0]][0])
            one = [i for i in one if kind(spans[i][0]) == first]
        picked = set(one)
        self._each = [s for i, s in enumerate(spans) if i not in picked]
        self._rows = [spans[i] for i in one]
        # every span in the one call: the layer may hand it RoPE too (write_attend's rope)
        self.rows_only = bool(self._rows) and not self._each
        self._tabs = None  # attention_rows' per-sequence tables, made on the first layer

    def _tables(self, n_heads: int) -> tuple:
        caches = [c for c, _, _ in self._rows]
        u64 = np.uint64
        return (
            np.array([a for _, a, _ in self._rows], np.int64),
            np.array([c.k_ptrs.ctypes.data for c in caches], u64),
            np.array([c.v_ptrs.ctypes.data for c in caches], u64),
            np.array([c.k_ptrs.shape[1] for c in caches], np.int64),
            np.array([c.offset for c in caches], np.int64),
            np.array([c._decode_tab(n_heads).ctypes.data for c in caches], u64),
        )

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        for cache, a, b in self.spans:
            cache.write(layer, k[a:b], v[a:b])

    def attend(self, layer: int, q: np.ndarray, out: np.ndarray) -> np.ndarray:
        for cache, a, b in self.spans:
            cache.attend(layer, q[a:b], out[a:b])
        return out

    def write_attend(
        self,
        layer: int,
        q: np.ndarray,
        k: np.ndarray,
        v: np.ndarray,
        out: np.ndarray,
        rope: tuple | None = None,
    ) -> np.ndarray:
        """`write` then `attend`: q, k, v, out C-contiguous (rows, n). rope (only when
        `rows_only`): q and k are not rotated yet, the kernel norms and rotates them first
        (kernels.attention_rows' rope)."""
        if rope is not None and not self.rows_only:
            raise ValueError("CacheRows.write_attend: rope needs every span in the one call")
        for cache, a, b in self._each:
            cache.write(layer, k[a:b], v[a:b])
            cache.attend(layer, q[a:b], out[a:b])
        if self._rows:
            c = self._rows[0][0]
            if self._tabs is None:
                self._tabs = self._tables(q.shape[1] // c.head_dim)
            K.attention_rows(
                q,
                k,
                v,
                out,
                *self._tabs,
                layer,
                KV_BLOCK,
                c.n_kv_heads,
                c.head_dim,
                c.scale,
                c.threads,
                c.kv_kind,
                rope,
            )
        return out
