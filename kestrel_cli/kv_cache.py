"""KV cache per SPEC §4: token-major blocks of `kv_bs` tokens, allocated as the sequence grows.

Layer l, token t: K at `k_blocks[l][t // kv_bs][t % kv_bs]`, a row of n_kv_heads*head_dim
floats (head h at columns h*head_dim...). Kernels get the blocks as a table of addresses
(`k_ptrs[l]`, uint64), so no block is ever moved or copied once written.
"""
from __future__ import annotations

import numpy as np

from .errors import KestrelError


class KVCache:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, max_tokens: int,
                 kv_bs: int = 32):
        self.n_layers, self.kv_bs, self.max_tokens = n_layers, kv_bs, max_tokens
        self.kv_dim = n_kv_heads * head_dim
        self.k_blocks: list[list[np.ndarray]] = [[] for _ in range(n_layers)]  # each (kv_bs, kv_dim)
        self.v_blocks: list[list[np.ndarray]] = [[] for _ in range(n_layers)]
        cap = -(-max_tokens // kv_bs)
        self.k_ptrs = np.zeros((n_layers, cap), dtype=np.uint64)   # block addresses
        self.v_ptrs = np.zeros((n_layers, cap), dtype=np.uint64)
        self.offset = 0                  # tokens committed

    @property
    def n_blocks(self) -> int:
        return len(self.k_blocks[0]) if self.n_layers else 0

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
                    b = np.empty((self.kv_bs, self.kv_dim), dtype=np.float32)
                    ptrs[len(blocks)] = b.ctypes.data
                    blocks.append(b)

    def write(self, layer: int, k: np.ndarray, v: np.ndarray) -> None:
        """Store K and V (T, kv_dim) of tokens offset..offset+T-1 (reserve() first)."""
        t, n = self.offset, k.shape[0]
        done = 0
        while done < n:
            b, r = divmod(t + done, self.kv_bs)
            m = min(n - done, self.kv_bs - r)
            self.k_blocks[layer][b][r:r + m] = k[done:done + m]
            self.v_blocks[layer][b][r:r + m] = v[done:done + m]
            done += m

    def views(self, layer: int, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
        """Block address tables covering the first `n_tokens` tokens of `layer`."""
        nb = -(-n_tokens // self.kv_bs)
        return self.k_ptrs[layer, :nb], self.v_ptrs[layer, :nb]

    def commit(self, n: int) -> None:
        self.offset += n

    def trim(self, n: int) -> None:
        """Keep the first `n` tokens; blocks past them are freed."""
        self.offset = min(n, self.offset)
        keep = -(-self.offset // self.kv_bs)
        for layer in range(self.n_layers):
            del self.k_blocks[layer][keep:]
            del self.v_blocks[layer][keep:]
            self.k_ptrs[layer, keep:] = 0
            self.v_ptrs[layer, keep:] = 0

    def reset(self) -> None:
        self.trim(0)

    @property
    def nbytes(self) -> int:
        """Bytes of KV held for the committed tokens (whole blocks)."""
        return sum(b.nbytes for blocks in self.k_blocks + self.v_blocks for b in blocks)

    def keys(self, layer: int) -> np.ndarray:
        """K of the committed tokens as one float32 (offset, kv_dim) array (tests, sparse)."""
        if not self.offset:
            return np.zeros((0, self.kv_dim), np.float32)
        return np.concatenate(self.k_blocks[layer])[:self.offset]
