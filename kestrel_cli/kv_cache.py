"""KV cache per SPEC §4: token-major blocks of `kv_bs` tokens, allocated as the sequence grows.

Layer l, token t: K at `k_blocks[l][t // kv_bs]`, row t % kv_bs, a row of n_kv_heads*head_dim
values (head h at columns h*head_dim...). Kernels get the blocks as a table of addresses
(`k_ptrs[l]`, uint64), so no block is ever moved or copied once written.

float32 cache: a block is float32 (kv_bs, kv_dim). int8 cache (`kv_q8`): a block is one
byte buffer, the int8 values (kv_bs, kv_dim) in the same places, then at byte
`scale_offset` (64-byte aligned) the float32 scales (n_kv_heads, kv_bs), one per (token,
kv head), symmetric: scale = max|x| / 127, x ~ scale * q. Scales are head-major so that the
sparse probes of one head (every 4th token) share cache lines. For head_dim 64 that is
(64 + 4) / 256 = 0.27 of the float32 bytes.

The cache also carries how it is read (`sparse_k`, `sparse_probes`: SPEC §5) and, per
layer, the prefill attention mass each token received (`importance`, float32
(n_layers, max_tokens)), which the attention kernel adds to during every prefill call
(T > 1; decode steps add nothing, so tokens after the prompt keep 0).
"""
from __future__ import annotations

import numpy as np

from . import kernels as K
from .errors import KestrelError
from .sparse import importance_order


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int,
                 kv_bs: int = 32, kv_q8: bool = False, sparse_k: int = 0,
                 sparse_probes: int = 8, threads: int | None = None):
        self.n_layers, self.kv_bs, self.max_tokens = n_layers, kv_bs, max_tokens
        self.n_kv_heads, self.head_dim = n_kv_heads, head_dim
        self.kv_dim = n_kv_heads * head_dim
        self.q8 = bool(kv_q8)
        self.sparse_k, self.sparse_probes = int(sparse_k), int(sparse_probes)
        if self.sparse_k and kv_bs != K.SPARSE_BS:
            raise KestrelError(f"sparse attention needs kv_bs == {K.SPARSE_BS}, got {kv_bs}")
        self.threads = threads
        # int8 blocks: values, then the scales at a 64-byte aligned offset
        self.scale_offset = -(-kv_bs * self.kv_dim // 64) * 64
        self.block_bytes = (self.scale_offset + kv_bs * n_kv_heads * 4 if self.q8
                            else kv_bs * self.kv_dim * 4)
        self.k_blocks: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
        self.v_blocks: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
        cap = -(-max_tokens // kv_bs)
        self.k_ptrs = np.zeros((n_layers, cap), dtype=np.uint64)   # block addresses
        self.v_ptrs = np.zeros((n_layers, cap), dtype=np.uint64)
        self.offset = 0                  # tokens committed
        # np.zeros maps pages lazily: memory is only touched for the tokens in use
        self.importance = np.zeros((n_layers, max_tokens), dtype=np.float32)
        self._has_imp = np.zeros(n_layers, dtype=bool)     # some prefill recorded here
        self._imp_end = 0                                  # tokens importance may cover
        self._order: list[np.ndarray | None] = [None] * n_layers   # importance_order cache
        self._slots: np.ndarray | None = None              # (SLOTS, max_tokens) scratch
        self._dec_tab: np.ndarray | None = None            # decode scratch (kernels.attention)
        self.record_selection = False    # tests: keep each layer's last sparse picks
        self.selection: list[np.ndarray | None] = [None] * n_layers

    @property
    def n_blocks(self) -> int:
        return len(self.k_blocks[0]) if self.n_layers else 0

    def _new_block(self) -> np.ndarray:
        if self.q8:
            return np.empty(self.block_bytes, dtype=np.uint8)
        return np.empty((self.kv_bs, self.kv_dim), dtype=np.float32)

    def _q8_views(self, block: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(values int8 (kv_bs, kv_dim), scales float32 (n_kv_heads, kv_bs)) of an int8 block."""
        n = self.kv_bs * self.kv_dim
        vals = block[:n].view(np.int8).reshape(self.kv_bs, self.kv_dim)
        scales = block[self.scale_offset:self.scale_offset + self.kv_bs * self.n_kv_heads * 4]
        return vals, scales.view(np.float32).reshape(self.n_kv_heads, self.kv_bs)

    def reserve(self, n_new: int) -> None:
        """Make room for `n_new` more tokens on every layer (allocating whole blocks)."""
        need = self.offset + n_new
        if need > self.max_tokens:
            raise KestrelError(f"context full: {need} tokens exceed the context size "
                               f"{self.max_tokens}")
        want = -(-need // self.kv_bs)
        for layer in range(self.n_layers):
            for blocks, ptrs in ((self.k_blocks[layer], self.k_ptrs[layer]),
                                 (self.v_blocks[layer], self.v_ptrs[layer])):
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
            b, r = divmod(t + done, self.kv_bs)
            m = min(n - done, self.kv_bs - r)
            if self.q8:
                for src, blocks in ((k, self.k_blocks), (v, self.v_blocks)):
                    vals, scales = self._q8_views(blocks[layer][b])
                    K.quantize_q8(src[done:done + m], self.head_dim, vals[r:r + m],
                                  scales[:, r:r + m].T, self.threads)
            else:
                self.k_blocks[layer][b][r:r + m] = k[done:done + m]
                self.v_blocks[layer][b][r:r + m] = v[done:done + m]
            done += m

    def views(self, layer: int, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Block address tables covering the first `n_tokens` tokens of `layer`."""
        nb = -(-n_tokens // self.kv_bs)
        return self.k_ptrs[layer, :nb], self.v_ptrs[layer, :nb]

    def attention_opts(self, layer: int, T: int, n_heads: int) -> dict:
        """Keyword arguments of `kernels.attention` for T query rows of `layer` after the
        cached tokens: the cache format, the sparse settings and the importance buffers."""
        opts = dict(kv_q8=self.q8, sparse_k=self.sparse_k, sparse_probes=self.sparse_probes)
        if self.sparse_k and self._has_imp[layer]:
            if self._order[layer] is None:       # recomputed after each prefill or trim
                self._order[layer] = importance_order(self.importance[layer], self.max_tokens,
                                                      self.kv_bs)
            opts["imp_order"] = self._order[layer]
        if T > 1:                                # prefill: record the attention mass
            if self._slots is None:
                self._slots = np.zeros((K.SLOTS, self.max_tokens), dtype=np.float32)
            opts.update(importance=self.importance[layer], imp_slots=self._slots)
            self._imp_end = max(self._imp_end, self.offset + T)
            self._has_imp[layer] = True
            self._order[layer] = None
        if T == 1:
            need = K.decode_tab_size(self.max_tokens, n_heads, self.head_dim, self.kv_bs)
            if self._dec_tab is None or self._dec_tab.shape[0] < need:
                self._dec_tab = np.empty(need, dtype=np.float32)
            opts["dec_tab"] = self._dec_tab
        if self.record_selection and self.sparse_k:
            sel = np.full((T, n_heads, self.sparse_k), -1, dtype=np.int32)
            self.selection[layer] = opts["sel"] = sel
        return opts

    def decode_args(self, layer: int, n_heads: int) -> tuple:
        """`attention_opts` for one decode row, as the positional tail of
        `kernels.attention_step`: (kv_q8, sparse_k, sparse_probes, imp_order, sel, dec_tab)."""
        o = self.attention_opts(layer, 1, n_heads)
        return (self.q8, self.sparse_k, self.sparse_probes, o.get("imp_order"), o.get("sel"),
                o["dec_tab"])

    def commit(self, n: int) -> None:
        self.offset += n

    def trim(self, n: int) -> None:
        """Keep the first `n` tokens; blocks past them are freed, their importance cleared."""
        self.offset = min(n, self.offset)
        keep = -(-self.offset // self.kv_bs)
        for layer in range(self.n_layers):
            del self.k_blocks[layer][keep:]
            del self.v_blocks[layer][keep:]
            self.k_ptrs[layer, keep:] = 0
            self.v_ptrs[layer, keep:] = 0
        self.importance[:, self.offset:self._imp_end] = 0
        self._imp_end = self.offset
        self._order = [None] * self.n_layers
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
            return np.concatenate(blocks)[:self.offset]
        rows = []
        for i, b in enumerate(blocks):
            n = min(self.kv_bs, self.offset - i * self.kv_bs)    # rows written
            if n <= 0:
                break
            vals, scales = self._q8_views(b)
            rows.append((vals[:n].reshape(n, self.n_kv_heads, self.head_dim)
                         * scales.T[:n, :, None]).reshape(n, self.kv_dim))
        return np.concatenate(rows).astype(np.float32)

    def keys(self, layer: int) -> np.ndarray:
        """K of the committed tokens as one float32 (offset, kv_dim) array, dequantised
        from an int8 cache (tests and the sparse reference; not used by the engine)."""
        return self._gather(self.k_blocks[layer])

    def values(self, layer: int) -> np.ndarray:
        """V of the committed tokens, as `keys`."""
        return self._gather(self.v_blocks[layer])
