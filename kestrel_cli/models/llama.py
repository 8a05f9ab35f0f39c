"""The reference decoder (Llama); Qwen models subclass it and override one hook each.

Python owns shapes, the layer loop and dispatch; every loop over hidden size or the
sequence is a kernel (kestrel_cli.kernels). Weights keep their safetensors names.
"""
from __future__ import annotations

import math
import time

import numpy as np

from .. import kernels as K
from ..config import Config
from ..kv_cache import KVCache
from ..loader import TensorStore


class Profile:
    """Wall time spent in attention kernels and in weight matmuls (seconds, cumulative)."""

    __slots__ = ("attn", "matmul")

    def __init__(self):
        self.attn = self.matmul = 0.0

    def snapshot(self) -> tuple[float, float]:
        return self.attn, self.matmul


class Ctx:
    """What one forward call shares across layers: threads, positions, timers."""

    def __init__(self, threads: int, positions: np.ndarray, pos0: int, prof: Profile):
        self.threads = int(threads) if threads else 0        # 0: OpenMP default
        self.positions, self.pos0, self.prof = positions, pos0, prof

    def mm(self, x: np.ndarray, w, bias=None, residual=None) -> np.ndarray:
        """x (T, n) @ w.T -> (T, d) float32 (+ bias); with `residual` (T, d), added into it
        (one token: inside the kernel) and residual returned."""
        if residual is not None and bias is None and x.shape[0] == 1:
            t0 = time.perf_counter()
            K.GemvGroup.of(w)(x, residual, self.threads, accumulate=True)
            self.prof.matmul += time.perf_counter() - t0
            return residual
        out = np.empty((x.shape[0], w.shape[0]), dtype=np.float32)
        t0 = time.perf_counter()
        K.matmul(x, w, out, self.threads)
        self.prof.matmul += time.perf_counter() - t0
        if bias is not None:
            out += bias
        if residual is not None:
            residual += out
            return residual
        return out

    def mm_group(self, x: np.ndarray, group: K.GemvGroup, biases=(), norm=None
                 ) -> list[np.ndarray]:
        """One token: x (1, n) @ w.T for each weight of `group` in one kernel call (decode's
        q/k/v, gate/up + SwiGLU), of RMSNorm(x) when norm = (weight, eps); (1, d_i) views
        of one new buffer (+ bias_i)."""
        out = np.empty((1, group.d), dtype=np.float32)
        t0 = time.perf_counter()
        if norm is None:
            outs = group(x, out, self.threads)
        else:
            outs = group(x, out, self.threads, norm=norm[0], eps=norm[1])
        self.prof.matmul += time.perf_counter() - t0
        for o, b in zip(outs, biases):
            if b is not None:
                o += b
        return outs


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, threads: int) -> np.ndarray:
    """Row-wise RMSNorm of x (R, n) into a new array."""
    out = np.empty_like(x)
    K.rms_norm(x, weight, eps, out, threads)
    return out


class Attention:
    has_qkv_bias = False          # qwen2 overrides

    def __init__(self, cfg: Config, store: TensorStore, p: str):
        H, nh, nkv, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg, self.n_heads, self.n_kv_heads, self.head_dim = cfg, nh, nkv, hd
        self.q_proj = store.matrix(f"{p}.q_proj.weight", (nh * hd, H))      # (nh*hd, H)
        self.k_proj = store.matrix(f"{p}.k_proj.weight", (nkv * hd, H))     # (nkv*hd, H)
        self.v_proj = store.matrix(f"{p}.v_proj.weight", (nkv * hd, H))
        self.o_proj = store.matrix(f"{p}.o_proj.weight", (H, nh * hd))
        bias = self.has_qkv_bias or bool(cfg.attention_bias)
        self.q_bias = store.vector(f"{p}.q_proj.bias", (nh * hd,)) if bias else None
        self.k_bias = store.vector(f"{p}.k_proj.bias", (nkv * hd,)) if bias else None
        self.v_bias = store.vector(f"{p}.v_proj.bias", (nkv * hd,)) if bias else None
        self.o_bias = store.vector(f"{p}.o_proj.bias", (H,)) if cfg.attention_bias else None
        self.qkv = K.GemvGroup([self.q_proj, self.k_proj, self.v_proj])
        self.scale = 1.0 / math.sqrt(hd)

    def pre_rope(self, q: np.ndarray, k: np.ndarray, threads: int) -> tuple[np.ndarray, np.ndarray]:
        """Hook before RoPE on q (T, nh, hd) and k (T, nkv, hd); llama: identity."""
        return q, k

    def __call__(self, x, cache: KVCache, layer: int, ctx: Ctx, rope, norm=None,
                 residual=None) -> np.ndarray:
        """Attention of x (T, H), or of RMSNorm(x) with norm = (weight, eps); with
        `residual`, the output is added into it (and it is returned)."""
        T = x.shape[0]
        if T == 1:      # decode: (RMSNorm,) q, k, v in one kernel call
            q, k, v = ctx.mm_group(x, self.qkv, (self.q_bias, self.k_bias, self.v_bias), norm)
        else:
            if norm is not None:
                x = rms_norm(x, norm[0], norm[1], ctx.threads)
            q = ctx.mm(x, self.q_proj, self.q_bias)
            k = ctx.mm(x, self.k_proj, self.k_bias)
            v = ctx.mm(x, self.v_proj, self.v_bias)
        q = q.reshape(T, self.n_heads, self.head_dim)
        k = k.reshape(T, self.n_kv_heads, self.head_dim)
        q, k = self.pre_rope(q, k, ctx.threads)
        inv_freq, attn_scale = rope
        rope_fn = K.rope_step if T == 1 else K.rope      # decode: the unchecked entries
        rope_fn(q, ctx.positions, inv_freq, attn_scale, ctx.threads)
        rope_fn(k, ctx.positions, inv_freq, attn_scale, ctx.threads)
        cache.write(layer, k.reshape(T, -1), v)
        k_ptrs, v_ptrs = cache.views(layer, ctx.pos0 + T)
        out = np.empty((T, self.n_heads * self.head_dim), dtype=np.float32)
        t0 = time.perf_counter()
        # exact or block-sparse, float32 or int8 KV: how the cache is read is the cache's
        if T == 1:
            K.attention_step(q.reshape(T, -1), k_ptrs, v_ptrs, cache.kv_bs, self.n_kv_heads,
                             self.head_dim, ctx.pos0, self.scale, out, ctx.threads,
                             *cache.decode_args(layer, self.n_heads))
        else:
            K.attention(q.reshape(T, -1), k_ptrs, v_ptrs, cache.kv_bs, self.n_kv_heads,
                        self.head_dim, ctx.pos0, self.scale, out, ctx.threads,
                        **cache.attention_opts(layer, T, self.n_heads))
        ctx.prof.attn += time.perf_counter() - t0
        return ctx.mm(out, self.o_proj, self.o_bias, residual)


class MLP:
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: Config, store: TensorStore, p: str, inter: int | None = None):
        H, inter = cfg.hidden_size, inter or cfg.intermediate_size
        self.gate_proj = store.matrix(f"{p}.gate_proj.weight", (inter, H))   # (I, H)
        self.up_proj = store.matrix(f"{p}.up_proj.weight", (inter, H))       # (I, H)
        self.down_proj = store.matrix(f"{p}.down_proj.weight", (H, inter))   # (H, I)
        self.gate_up = K.GemvGroup([self.gate_proj, self.up_proj], swiglu=True)

    def __call__(self, x, ctx: Ctx, norm=None, residual=None) -> np.ndarray:
        """MLP of x (T, H), or of RMSNorm(x) with norm = (weight, eps); with `residual`,
        the output is added into it (and it is returned)."""
        if x.shape[0] == 1:     # decode: (RMSNorm,) gate, up and SwiGLU in one kernel call
            g = ctx.mm_group(x, self.gate_up, norm=norm)[0]
        else:
            if norm is not None:
                x = rms_norm(x, norm[0], norm[1], ctx.threads)
            g = ctx.mm(x, self.gate_proj)
            u = ctx.mm(x, self.up_proj)
            K.swiglu(g, u, g, ctx.threads)
        return ctx.mm(g, self.down_proj, residual=residual)


class DecoderLayer:
    def __init__(self, model: "Model", cfg: Config, store: TensorStore, i: int):
        p = f"{model.prefix}.layers.{i}"
        H = cfg.hidden_size
        self.eps = cfg.rms_norm_eps
        self.input_layernorm = store.vector(f"{p}.input_layernorm.weight", (H,))
        self.post_attention_layernorm = store.vector(f"{p}.post_attention_layernorm.weight", (H,))
        self.self_attn = model.attention_cls(cfg, store, f"{p}.self_attn")
        self.mlp = self.make_mlp(cfg, store, f"{p}.mlp", i)

    def make_mlp(self, cfg: Config, store: TensorStore, p: str, i: int):
        return MLP(cfg, store, p)

    def __call__(self, h, cache, layer, ctx, rope) -> None:
        """Updates the residual stream h (T, H) in place."""
        if h.shape[0] == 1:
            # decode: each RMSNorm runs inside the kernel call of the projections after it
            # and o_proj / down_proj add into h: 5 kernel calls fewer per layer and token
            self.self_attn(h, cache, layer, ctx, rope, (self.input_layernorm, self.eps), h)
            post = (self.post_attention_layernorm, self.eps)
            if isinstance(self.mlp, MLP):
                self.mlp(h, ctx, post, h)
            else:
                h += self.mlp(rms_norm(h, post[0], post[1], ctx.threads), ctx)
            return
        h += self.self_attn(rms_norm(h, self.input_layernorm, self.eps, ctx.threads), cache, layer, ctx, rope)
        h += self.mlp(rms_norm(h, self.post_attention_layernorm, self.eps, ctx.threads), ctx)


class Model:
    prefix = "model"                     # qwen3_vl: "model.language_model"
    attention_cls = Attention
    layer_cls = DecoderLayer

    def __init__(self, cfg: Config, store: TensorStore, threads: int = 1):
        V, H = cfg.vocab_size, cfg.hidden_size
        self.cfg, self.threads = cfg, threads
        self.embed_tokens = store.matrix(f"{self.prefix}.embed_tokens.weight", (V, H))  # (V, H)
        self.layers = [self.layer_cls(self, cfg, store, i) for i in range(cfg.num_hidden_layers)]
        self.norm = store.vector(f"{self.prefix}.norm.weight", (H,))
        if cfg.tie_word_embeddings and "lm_head.weight" not in store:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = store.matrix("lm_head.weight", (V, H))                      # (V, H)
        self.rope = cfg.rope_inv_freq()
        self.prof = Profile()

    cache_opts: dict = {}                # KVCache options (kv_q8, sparse_k, ...) the Engine sets

    def make_cache(self, max_tokens: int, kv_bs: int = 32, **opts) -> KVCache:
        """A KV cache for this model; `opts` (kv_q8, sparse_k, sparse_probes) override
        `self.cache_opts`."""
        c = self.cfg
        return KVCache(c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_tokens, kv_bs,
                       **{"threads": self.threads, **self.cache_opts, **opts})

    def __call__(self, ids, cache: KVCache, all_logits: bool = False) -> np.ndarray:
        """Run tokens `ids` after the cached ones; logits (T, V) or of the last token (1, V)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        T, pos0 = ids.shape[0], cache.offset
        cache.reserve(T)
        ctx = Ctx(self.threads, np.arange(pos0, pos0 + T, dtype=np.int64), pos0, self.prof)
        h = np.empty((T, self.cfg.hidden_size), dtype=np.float32)    # residual stream (T, H)
        K.get_rows(self.embed_tokens, ids, h)
        for i, layer in enumerate(self.layers):
            layer(h, cache, i, ctx, self.rope)
        cache.commit(T)
        if not all_logits:
            h = h[-1:]
        return ctx.mm(rms_norm(np.ascontiguousarray(h), self.norm, self.cfg.rms_norm_eps, self.threads),
                      self.lm_head)
