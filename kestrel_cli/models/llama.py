"""The reference decoder (Llama); Qwen models subclass it and override one hook each.

Python owns shapes, the layer loop and dispatch; every loop over hidden size or the
sequence is a kernel (kestrel_cli.runtime.kernels). Weights keep their safetensors names.
"""

from __future__ import annotations

import time

import numpy as np

from kestrel_cli.formats.config import Config
from kestrel_cli.models.loader import TensorStore
from kestrel_cli.runtime import kernels as K
from kestrel_cli.runtime.kv_cache import CacheRows, CacheSpec, KVCache

ACT_MODES = ("f32", "q8")  # activations of quantised matmuls (Model.act)


class Profile:
    """Wall time spent in attention kernels and in weight matmuls (seconds, cumulative)."""

    __slots__ = ("attn", "matmul")

    def __init__(self):
        self.attn = self.matmul = 0.0

    def snapshot(self) -> tuple[float, float]:
        return self.attn, self.matmul


class ForwardPass:
    """What one model call shares across its layers: threads, the positions of its tokens,
    the RoPE tables, the timing profile and the activation mode of quantised matmuls
    (act_q8: int8 activation blocks, else float32; see kernels.matmul)."""

    __slots__ = ("threads", "positions", "rope", "prof", "act_q8")

    def __init__(self, threads: int, positions: np.ndarray, rope, prof: Profile, act_q8: bool):
        self.threads, self.positions, self.rope, self.prof = threads, positions, rope, prof
        self.act_q8 = act_q8

    def project(self, proj: K.Projection, x: np.ndarray, residual=None) -> list[np.ndarray]:
        """proj's outputs for the rows of x (or [residual] after adding into it), timed as
        matmul."""
        t0 = time.perf_counter()
        outs = proj(x, self.threads, residual, self.act_q8)
        self.prof.matmul += time.perf_counter() - t0
        return outs


def rms_norm(x: np.ndarray, weight: np.ndarray, eps: float, threads: int) -> np.ndarray:
    """Row-wise RMSNorm of x (R, n) into a new array."""
    out = np.empty_like(x)
    K.rms_norm(x, weight, eps, out, threads)
    return out


class Attention:
    """Self-attention of RMSNorm(x): q/k/v projections, RoPE, the KV cache, o_proj."""

    has_qkv_bias = False  # qwen2 overrides

    def __init__(self, cfg: Config, store: TensorStore, p: str, norm: np.ndarray):
        H, nh, nkv, hd = (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
        )
        self.cfg, self.n_heads, self.n_kv_heads, self.head_dim = cfg, nh, nkv, hd
        self.q_proj = store.matrix(f"{p}.q_proj.weight", (nh * hd, H))  # (nh*hd, H)
        self.k_proj = store.matrix(f"{p}.k_proj.weight", (nkv * hd, H))  # (nkv*hd, H)
        self.v_proj = store.matrix(f"{p}.v_proj.weight", (nkv * hd, H))
        self.o_proj = store.matrix(f"{p}.o_proj.weight", (H, nh * hd))
        bias = self.has_qkv_bias or bool(cfg.attention_bias)
        self.q_bias = store.vector(f"{p}.q_proj.bias", (nh * hd,)) if bias else None
        self.k_bias = store.vector(f"{p}.k_proj.bias", (nkv * hd,)) if bias else None
        self.v_bias = store.vector(f"{p}.v_proj.bias", (nkv * hd,)) if bias else None
        self.o_bias = store.vector(f"{p}.o_proj.bias", (H,)) if cfg.attention_bias else None
        # norm (H,): the layer's input_layernorm, applied inside the q/k/v projection
        self.qkv = K.Projection(
            [self.q_proj, self.k_proj, self.v_proj],
            [self.q_bias, self.k_bias, self.v_bias],
            norm=norm,
            eps=cfg.rms_norm_eps,
        )
        self.out = K.Projection([self.o_proj], [self.o_bias])

    def pre_rope(self, q: np.ndarray, k: np.ndarray, threads: int) -> tuple[np.ndarray, np.ndarray]:
        """Hook before RoPE on q (T, nh, hd) and k (T, nkv, hd); llama: identity."""
        return q, k

    def head_norms(self) -> tuple[np.ndarray | None, np.ndarray | None] | None:
        """What pre_rope does, for the native decode (kernels.DecodeStack): the (q_norm,
        k_norm) per-head RMSNorm weights, (None, None) for none, or None when pre_rope or
        apply_rope does something else (then decode runs this Python loop); llama: none."""
        return None, None

    def rows_rope(self, fwd: ForwardPass) -> tuple | None:
        """What pre_rope and apply_rope do, for kernels.attention_rows (CacheRows whose
        every span is one decode row): (positions, inv_freq, attn_scale, q_norm, k_norm,
        eps), or None when they do something else (then they run here)."""
        norms = self.head_norms()
        inv_freq, attn_scale = fwd.rope
        if norms is None or 2 * inv_freq.shape[0] != self.head_dim:
            return None
        return (fwd.positions, inv_freq, attn_scale, *norms, self.cfg.rms_norm_eps)

    def apply_rope(self, q: np.ndarray, k: np.ndarray, fwd: ForwardPass) -> None:
        """RoPE in place on q (T, nh, hd) and k (T, nkv, hd) at fwd.positions (T,)."""
        inv_freq, attn_scale = fwd.rope
        K.rope_unchecked(q, fwd.positions, inv_freq, attn_scale, fwd.threads)
        K.rope_unchecked(k, fwd.positions, inv_freq, attn_scale, fwd.threads)

    def __call__(
        self, x, cache: KVCache, layer: int, fwd: ForwardPass, residual=None
    ) -> np.ndarray:
        """Attention of RMSNorm(x), x (T, H); with `residual` (T, H), the output is added
        into it (and it is returned)."""
        T = x.shape[0]
        q, k, v = fwd.project(self.qkv, x)
        if cache.rows_only and fwd.positions.ndim == 1:
            rope = self.rows_rope(fwd)
            if rope is not None:  # the head norms and RoPE inside the one kernel call
                out = np.empty((T, self.n_heads * self.head_dim), dtype=np.float32)
                t0 = time.perf_counter()
                cache.write_attend(layer, q, k, v, out, rope)
                fwd.prof.attn += time.perf_counter() - t0
                return fwd.project(self.out, out, residual)[0]
        q = q.reshape(T, self.n_heads, self.head_dim)
        k = k.reshape(T, self.n_kv_heads, self.head_dim)
        q, k = self.pre_rope(q, k, fwd.threads)
        self.apply_rope(q, k, fwd)
        out = np.empty((T, self.n_heads * self.head_dim), dtype=np.float32)
        t0 = time.perf_counter()  # attention with its K/V writes, as the native decode times it
        cache.write_attend(layer, q.reshape(T, -1), k.reshape(T, -1), v, out)
        fwd.prof.attn += time.perf_counter() - t0
        return fwd.project(self.out, out, residual)[0]


class MLP:
    """SwiGLU: down(silu(gate(x)) * up(x)), of RMSNorm(x) when given a norm weight."""

    def __init__(
        self,
        cfg: Config,
        store: TensorStore,
        p: str,
        inter: int | None = None,
        norm: np.ndarray | None = None,
    ):
        H, inter = cfg.hidden_size, inter or cfg.intermediate_size
        self.gate_proj = store.matrix(f"{p}.gate_proj.weight", (inter, H))  # (I, H)
        self.up_proj = store.matrix(f"{p}.up_proj.weight", (inter, H))  # (I, H)
        self.down_proj = store.matrix(f"{p}.down_proj.weight", (H, inter))  # (H, I)
        self.gate_up = K.Projection(
            [self.gate_proj, self.up_proj], norm=norm, eps=cfg.rms_norm_eps, swiglu=True
        )
        self.down = K.Projection([self.down_proj])

    def use_weights(self, gate, up, down) -> None:
        """Multiply by these weights from now on (the same values in another layout: a MoE
        expert repacked by its ExpertTable)."""
        g = self.gate_up
        self.gate_proj, self.up_proj, self.down_proj = gate, up, down
        self.gate_up = K.Projection([gate, up], norm=g.norm, eps=g.eps, swiglu=True)
        self.down = K.Projection([down])

    def __call__(self, x, fwd: ForwardPass, residual=None) -> np.ndarray:
        """MLP of x (T, H) (of RMSNorm(x) with a norm); with `residual` (T, H), the output
        is added into it (and it is returned)."""
        (g,) = fwd.project(self.gate_up, x)
        return fwd.project(self.down, g, residual)[0]


class DecoderLayer:
    """Pre-norm residual block: h += attn(RMSNorm(h)); h += mlp(RMSNorm(h)). Each RMSNorm
    runs inside the projections after it, and o_proj / down_proj add into h (for one
    token: all inside the kernel calls)."""

    def __init__(self, model: "Model", cfg: Config, store: TensorStore, i: int):
        p = f"{model.prefix}.layers.{i}"
        H = cfg.hidden_size
        self.input_layernorm = store.vector(f"{p}.input_layernorm.weight", (H,))
        self.post_attention_layernorm = store.vector(f"{p}.post_attention_layernorm.weight", (H,))
        self.self_attn = model.attention_cls(cfg, store, f"{p}.self_attn", self.input_layernorm)
        self.mlp = self.make_mlp(cfg, store, f"{p}.mlp", i)

    def make_mlp(self, cfg: Config, store: TensorStore, p: str, i: int):
        """The feed-forward block of layer i, reading RMSNorm(h) with
        post_attention_layernorm."""
        return MLP(cfg, store, p, norm=self.post_attention_layernorm)

    def native_parts(self):
        """This layer for kernels.DecodeStack: (qkv, o, gate_up, down, head norms), or
        None when it is not a block the stack runs."""
        norms = self.self_attn.head_norms()
        mlp = self.native_mlp()
        if norms is None or mlp is None:
            return None
        a = self.self_attn
        return a.qkv, a.out, *mlp, norms

    def native_mlp(self):
        """The feed-forward's part of native_parts: (gate_up, down) of a SwiGLU MLP, or
        None."""
        return (self.mlp.gate_up, self.mlp.down) if type(self.mlp) is MLP else None

    def __call__(self, h, cache: KVCache, layer: int, fwd: ForwardPass) -> None:
        """Updates the residual stream h (T, H) in place."""
        self.self_attn(h, cache, layer, fwd, residual=h)
        self.mlp(h, fwd, residual=h)


class Model:
    prefix = "model"  # qwen3_vl: "model.language_model"
    attention_cls = Attention
    layer_cls = DecoderLayer

    def __init__(self, cfg: Config, store: TensorStore, threads: int = 1, act: str = "f32"):
        V, H = cfg.vocab_size, cfg.hidden_size
        self.cfg = cfg
        self.threads = int(threads or 0)  # OpenMP threads of every kernel call (0: default)
        # activations of quantised matmuls (--act, docs/DESIGN.md §5 Kernels and ISAs):
        # "f32" float32 (exact, the default), "q8" int8 blocks (llama.cpp's choice)
        if act not in ACT_MODES:
            raise ValueError(f"act must be one of {', '.join(ACT_MODES)}, got {act!r}")
        self.act = act
        tied = cfg.tie_word_embeddings and "lm_head.weight" not in store
        # an untied embedding is only gathered from: it stays mapped (store.matrix)
        self.embed_tokens = store.matrix(
            f"{self.prefix}.embed_tokens.weight", (V, H), streamed=tied
        )  # (V, H)
        self.layers = [self.layer_cls(self, cfg, store, i) for i in range(cfg.num_hidden_layers)]
        self.norm = store.vector(f"{self.prefix}.norm.weight", (H,))
        if tied:
            self.lm_head = self.embed_tokens
        else:
            self.lm_head = store.matrix("lm_head.weight", (V, H))  # (V, H)
        self.head = K.Projection([self.lm_head])
        self.rope = cfg.rope_inv_freq()
        self.prof = Profile()
        # decode one token in one kernel call (kernels.DecodeStack) where every layer is
        # one it runs; False: the Python layer loop (tests compare the two)
        self.native_decode = True
        self._stack = None  # the DecodeStack, built on first use; False: none

    def make_cache(self, max_tokens: int, spec: CacheSpec = CacheSpec()) -> KVCache:
        """An empty KV cache for this model, of `max_tokens` tokens, as `spec` says."""
        c = self.cfg
        return KVCache(
            c.num_hidden_layers, c.num_key_value_heads, c.head_dim, max_tokens, spec, self.threads
        )

    def __call__(
        self,
        ids,
        cache: KVCache,
        all_logits: bool = False,
        act: str | None = None,
        positions: np.ndarray | None = None,
    ) -> np.ndarray:
        """Run tokens `ids` after the cached ones; logits (T, V) or of the last token (1, V).
        act: this call's activation mode (None: the model's). positions: int64 (T,) RoPE
        positions (None: the cache offsets; qwen3_vl shifts them after an image)."""
        return self.forward(ids, cache, all_logits, act, positions)

    def decode_stack(self) -> K.DecodeStack | None:
        """The native decode of this model (built once), or None: native_decode is off, or
        some layer is not one kernels.DecodeStack runs, or RoPE does not cover the
        head."""
        if not self.native_decode:
            return None
        if self._stack is None:
            c = self.cfg
            parts = [layer.native_parts() for layer in self.layers]
            inv_freq, _ = self.rope
            ok = parts and all(p is not None for p in parts) and 2 * inv_freq.shape[0] == c.head_dim
            self._stack = (
                K.DecodeStack(
                    parts,
                    c.num_attention_heads,
                    c.num_key_value_heads,
                    c.head_dim,
                    c.rms_norm_eps,
                    self.rope,
                )
                if ok
                else False
            )
        return self._stack or None

    def add_inputs(self, h: np.ndarray, extra) -> None:
        """Hook after the token embeddings of h (T, H) are read: a subclass's per-call
        inputs `extra` go in (qwen3_vl: image embeddings); llama: nothing."""

    def after_layer(self, h: np.ndarray, i: int, extra) -> None:
        """Hook after decoder layer i updated h (qwen3_vl: DeepStack features); llama:
        nothing."""

    def forward(
        self,
        ids,
        cache: KVCache,
        all_logits: bool,
        act: str | None,
        positions: np.ndarray | None,
        extra=None,
    ) -> np.ndarray:
        """__call__'s body; `extra` reaches the add_inputs / after_layer hooks."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        T, pos0 = ids.shape[0], cache.offset
        cache.reserve(T)
        act = act or self.act
        if positions is None:
            positions = np.arange(pos0, pos0 + T, dtype=np.int64)
        fwd = ForwardPass(self.threads, positions, self.rope, self.prof, act == "q8")
        h = np.empty((T, self.cfg.hidden_size), dtype=np.float32)  # residual stream (T, H)
        K.get_rows(self.embed_tokens, ids, h)
        self.add_inputs(h, extra)
        stack = (
            self.decode_stack()
            if (T == 1 and extra is None and positions.ndim == 1 and not cache.record_selection)
            else None
        )
        if stack is not None:  # one kernel call for every layer
            a0, m0 = stack.times
            stack.run(h, int(positions[0]), cache.decode_attention(stack.n_heads), fwd.act_q8)
            a1, m1 = stack.times
            self.prof.attn += a1 - a0
            self.prof.matmul += m1 - m0
        else:
            for i, layer in enumerate(self.layers):
                layer(h, cache, i, fwd)
                self.after_layer(h, i, extra)
        cache.commit(T)
        if not all_logits:
            h = h[-1:]
        h = rms_norm(np.ascontiguousarray(h), self.norm, self.cfg.rms_norm_eps, self.threads)
        return fwd.project(self.head, h)[0]

    def forward_rows(self, segs) -> list[np.ndarray | None]:
        """One pass over the tokens of several sequences, each with its own cache
        (continuous batching, inference/batch.py): the weights are read once for all the
        rows, attention runs per sequence over its cache.

        Args:
            segs: (cache, ids, positions, want) per sequence: its tokens run after those
                in its cache, at RoPE positions (int64 (n,); None: the cache offsets);
                want "last" (logits (1, V) of its last token), "all" ((n, V)) or None.
        Returns:
            the logits each sequence wants (None where it wants none), in segs' order.
        """
        if len(segs) == 1:  # one sequence: the plain call (the native decode for a token)
            cache, ids, positions, want = segs[0]
            out = self.forward(ids, cache, want == "all", None, positions, None)
            return [out if want else None]
        ids = np.concatenate([np.asarray(s[1], dtype=np.int64).reshape(-1) for s in segs])
        spans, a = [], 0
        for cache, seq, _, _ in segs:
            spans.append((cache, a, a + len(seq)))
            a += len(seq)
        for cache, a, b in spans:
            cache.reserve(b - a)
        positions = np.concatenate(
            [
                np.arange(c.offset, c.offset + b - a, dtype=np.int64)
                if s[2] is None
                else np.asarray(s[2], dtype=np.int64).reshape(-1)
                for s, (c, a, b) in zip(segs, spans)
            ]
        )
        fwd = ForwardPass(self.threads, positions, self.rope, self.prof, self.act == "q8")
        h = np.empty((ids.shape[0], self.cfg.hidden_size), dtype=np.float32)
        K.get_rows(self.embed_tokens, ids, h)
        self.add_inputs(h, None)
        rows = CacheRows(spans)
        for i, layer in enumerate(self.layers):
            layer(h, rows, i, fwd)
            self.after_layer(h, i, None)
        for cache, a, b in spans:
            cache.commit(b - a)
        # the rows whose logits are wanted, through the final norm and the head at once
        pick = []
        for (_, a, b), s in zip(spans, segs):
            if s[3] == "all":
                pick.extend(range(a, b))
            elif s[3]:
                pick.append(b - 1)
        outs: list[np.ndarray | None] = [None] * len(segs)
        if pick:
            x = np.ascontiguousarray(h[pick])
            x = rms_norm(x, self.norm, self.cfg.rms_norm_eps, self.threads)
            logits = fwd.project(self.head, x)[0]
            j = 0
            for i, ((_, a, b), s) in enumerate(zip(spans, segs)):
                n = (b - a) if s[3] == "all" else (1 if s[3] else 0)
                if n:
                    outs[i] = logits[j : j + n]
                    j += n
        return outs
