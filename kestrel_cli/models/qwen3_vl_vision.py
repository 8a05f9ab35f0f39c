"""Qwen3-VL vision tower (`model.visual.*`): pixels -> image embeddings for the decoder.

transformers' Qwen3VLVisionModel is the numerical reference (fp32):
  patch embedding   Conv3d(3, H, (2, 16, 16), stride = kernel) over flattened patches, so
                    one matmul (N, 3*2*16*16) @ W.T + b; a still image is its frame twice
                    (the preprocessing repeats it, images.py)
  position          the learned (S, S) table, bilinear-resampled (align_corners) to the
                    image's (gh, gw) patch grid, added to the patch embeddings
  blocks            h += proj(attn(LN1(h))); h += fc2(gelu_tanh(fc1(LN2(h)))); attention is
                    full (not causal) within one image, with 2-D RoPE: the first half of
                    each head's rotary angles follow the patch row, the second its column
  merger            LN(H) per patch, then 2x2 neighbouring patches (consecutive in the
                    merge-block order images.py emits) concatenated: fc2(gelu(fc1(.)))
                    into the decoder's width
  deepstack         after the blocks in deepstack_visual_indexes, a merger with LN over the
                    concatenated 4H (postshuffle norm); its output j is added to the
                    decoder's hidden states at the image positions after decoder layer j
                    (qwen3_vl.Model)

Kernels: the matmuls are `kernels.matmul` (any weight format), the rotary embedding is
`kernels.rope` (two calls, rows then columns, each with the other half's frequencies zeroed:
a zero angle rotates by exactly nothing), attention is the prefill attention's tiles, not
causal (see `full_attention`); LayerNorm, bias + GELU and bias + residual add are `kernels.layer_norm`,
`bias_act` and `residual_add` (pyx/vision_ops.h), each one threaded pass.
The weights are used as stored (--quant does not touch the vision tower).

Two dtypes (`VisionTower.set_dtype`, `--vision-dtype`): "f32", the exact float path above,
and "bf16" (AVX512-BF16 only): every matmul on `kernels.matmul_bf16` (the weights converted
to bf16 once, the activations rounded per call), q, k and v from one fused matmul, and
attention on `kernels.attention_bf16` (bias, 2-D RoPE and the bf16 rounding of q, k, v in
its packing pass, vdpbf16ps for QK^T and PV, float32 softmax); LayerNorm, GELU and the
residual stream stay float32. "auto" (`resolve_dtype`) is bf16 where the CPU has
AVX512-BF16, else f32.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields

import numpy as np

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.formats.weights import Weight
from kestrel_cli.runtime import kernels as K

PREFIX = "model.visual"
DTYPES = ("auto", "f32", "bf16")  # --vision-dtype


def resolve_dtype(dtype: str) -> str:
    """The dtype the tower runs in for a --vision-dtype value: "auto" is "bf16" where the
    CPU has native bf16 dot products (`kernels.HAVE_BF16_DOT`: AVX512-BF16), else "f32";
    "bf16" asked where it has none is refused (KestrelError), never silently exact."""
    if dtype not in DTYPES:
        raise KestrelError(f"--vision-dtype must be one of {', '.join(DTYPES)}; got {dtype!r}")
    if dtype == "auto":
        return "bf16" if K.HAVE_BF16_DOT else "f32"
    if dtype == "bf16" and not K.HAVE_BF16_DOT:
        raise KestrelError(
            "--vision-dtype bf16 needs a CPU with AVX512-BF16 (bf16 dot products); this one "
            "has none: use --vision-dtype auto or f32"
        )
    return dtype


@dataclass
class VisionConfig:
    """config.json's vision_config (Hugging Face keys)."""

    depth: int = 27
    hidden_size: int = 1152
    hidden_act: str = "gelu_pytorch_tanh"
    intermediate_size: int = 4304
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 16
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    out_hidden_size: int = 3584
    num_position_embeddings: int = 2304
    deepstack_visual_indexes: list = field(default_factory=lambda: [8, 16, 24])
    rope_theta: float = 10000.0

    @classmethod
    def from_hf(cls, raw: dict) -> "VisionConfig":
        known = {f.name for f in fields(cls)}
        cfg = cls(**{k: v for k, v in raw.items() if k in known})
        rp = raw.get("rope_parameters") or {}
        if "rope_theta" in rp:
            cfg.rope_theta = float(rp["rope_theta"])
        if cfg.hidden_act not in ("gelu_pytorch_tanh",):
            raise KestrelError(
                f"vision_config hidden_act={cfg.hidden_act!r} is not supported "
                f"(only gelu_pytorch_tanh)"
            )
        if cfg.hidden_size % cfg.num_heads or (cfg.hidden_size // cfg.num_heads) % 4:
            raise KestrelError(
                f"vision_config: head size {cfg.hidden_size}/{cfg.num_heads} "
                f"must be a multiple of 4"
            )
        return cfg

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size**2


# ------------------------------------------------------------------------ pieces


def layer_norm(x: np.ndarray, w: np.ndarray, b: np.ndarray, threads: int) -> np.ndarray:
    """LayerNorm over the last axis (eps 1e-6), float32 (a new array)."""
    return K.layer_norm(x, w, b, 1e-6, np.empty_like(x), threads)


class PartClock:
    """Wall time per part of `VisionTower.encode` (scripts/bench_vision.py --parts): each
    lap(part) adds the time since the previous lap to that part. The kernels return only
    when their threads are done, so the laps split the wall time exactly."""

    def __init__(self):
        self.parts: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, part: str) -> None:
        now = time.perf_counter()
        self.parts[part] = self.parts.get(part, 0.0) + now - self._t
        self._t = now


class _NoClock:
    def lap(self, part: str) -> None:
        pass


_NO_CLOCK = _NoClock()


def to_bf16(w: Weight) -> Weight:
    """w as a bf16 Weight (itself when it is one): its float32 values rounded to nearest
    even (a block format dequantised first)."""
    if w.fmt == "bf16":
        return w
    u = np.ascontiguousarray(w.dequantize(), dtype=np.float32).view(np.uint32)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    r[nan] = ((u[nan] >> 16) | 0x40).astype(np.uint16)
    return Weight("bf16", r, w.shape)


class Linear:
    """y = act(x @ W.T + b): the matmul kernel, then the bias and the activation in one
    pass (`kernels.bias_act`). With `w16` set (VisionTower.set_dtype("bf16")), that bf16
    weight multiplies bf16-rounded activations (`kernels.matmul_bf16`)."""

    def __init__(self, w: Weight, b: np.ndarray | None):
        self.w, self.b = w, b
        self.w16: Weight | None = None

    @property
    def bf16(self) -> bool:
        return self.w16 is not None

    def matmul(self, x: np.ndarray, threads: int) -> np.ndarray:
        """x @ W.T alone (the caller adds the bias: `kernels.residual_add`)."""
        out = np.empty((x.shape[0], self.w.shape[0]), dtype=np.float32)
        x = np.ascontiguousarray(x)
        if self.w16 is not None:
            return K.matmul_bf16(x, self.w16, out, threads)
        return K.matmul(x, self.w, out, threads)

    def __call__(self, x: np.ndarray, threads: int, act: str | None = None) -> np.ndarray:
        out = self.matmul(x, threads)
        if self.b is not None or act is not None:
            K.bias_act(out, self.b, act, threads)
        return out


def _matrix(store, name: str, shape) -> Weight:
    """A weight as stored (never quantised here: the vision tower stays in its file's
    format, float or an mmproj GGUF's Q8_0); n-D (conv) weights as their (d, prod(rest))
    rows (a block format's raw rows are bytes: reshaped to d rows, not n columns)."""
    fmt, raw, actual = store._get(name, shape)
    d = actual[0]
    n = int(np.prod(actual[1:]))
    return Weight(fmt, raw.reshape(d, -1), (d, n))


def _linear(store, p: str, d: int, n: int) -> Linear:
    return Linear(_matrix(store, f"{p}.weight", (d, n)), store.vector(f"{p}.bias", (d,)))


# ------------------------------------------------------------------------ attention


ATTN_BS = 32  # rows per block handed to the attention kernel


def full_attention(
    q: np.ndarray, k: np.ndarray, v: np.ndarray, n_heads: int, head_dim: int, threads: int
) -> np.ndarray:
    """Non-causal attention of every row of q over all rows of k / v (one image):
    out[i, h] = softmax(q[i, h] . k[:, h] / sqrt(hd)) @ v[:, h]. q, k, v float32 (N, nh*hd).

    The prefill attention's tiles with `causal=False` (every row sees all N keys): the
    token-major (N, nh*hd) K and V are a float32 block cache as they lie (blocks of
    ATTN_BS rows, n_kv = n_heads), each tile of query rows reads each key and value once
    for all its queries, the online softmax never materialises the (N, N) scores."""
    N = q.shape[0]
    nb = -(-N // ATTN_BS)
    width = n_heads * head_dim
    k = np.ascontiguousarray(k, np.float32)
    v = np.ascontiguousarray(v, np.float32)
    step = np.uint64(ATTN_BS * width * 4)
    idx = np.arange(nb, dtype=np.uint64)
    k_ptrs = np.uint64(k.ctypes.data) + idx * step  # the last block partial: rows < N read
    v_ptrs = np.uint64(v.ctypes.data) + idx * step
    out = np.empty((N, width), np.float32)
    K.attention(
        np.ascontiguousarray(q, np.float32),
        k_ptrs,
        v_ptrs,
        ATTN_BS,
        n_heads,
        head_dim,
        0,
        float(head_dim) ** -0.5,
        out,
        threads,
        causal=False,
    )
    return out


# ------------------------------------------------------------------------ grid helpers


def merge_order_coords(gh: int, gw: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, col) of each patch in the order the processor emits them: m x m merge blocks
    in raster order, the patches of a block in raster order."""
    r = np.arange(gh).reshape(gh // m, m, 1, 1)
    c = np.arange(gw).reshape(1, 1, gw // m, m)
    rows = np.broadcast_to(r, (gh // m, m, gw // m, m)).transpose(0, 2, 1, 3).reshape(-1)
    cols = np.broadcast_to(c, (gh // m, m, gw // m, m)).transpose(0, 2, 1, 3).reshape(-1)
    return rows.astype(np.int64), cols.astype(np.int64)


def _axis_taps(index: np.ndarray, size: int, side: int):
    """Bilinear, align_corners=True taps (floor, floor+1, clamped) and weights along one
    axis, float32 as transformers computes them."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    fl = np.floor(src)
    taps = np.stack([fl, fl + 1], axis=1).astype(np.int64)
    dist = np.abs(src[:, None] - taps.astype(np.float32))
    w = np.clip(np.float32(1) - dist, 0, None).astype(np.float32)
    return np.clip(taps, 0, side - 1), w


def pos_embed_taps(gh: int, gw: int, side: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(indices (N, 4) into the flattened (side, side) table, weights (N, 4) float32) of
    the bilinear resampling to a (gh, gw) grid, patches in merge-block order."""
    rows, cols = merge_order_coords(gh, gw, m)
    ht, hw = _axis_taps(rows, gh, side)
    wt, ww = _axis_taps(cols, gw, side)
    idx = (ht[:, :, None] * side + wt[:, None, :]).reshape(-1, 4)
    wts = (hw[:, :, None] * ww[:, None, :]).reshape(-1, 4)
    return idx, wts


# ------------------------------------------------------------------------ the tower


class Block:
    def __init__(self, cfg: VisionConfig, store, p: str):
        H, I = cfg.hidden_size, cfg.intermediate_size
        self.norm1 = (
            store.vector(f"{p}.norm1.weight", (H,)),
            store.vector(f"{p}.norm1.bias", (H,)),
        )
        self.norm2 = (
            store.vector(f"{p}.norm2.weight", (H,)),
            store.vector(f"{p}.norm2.bias", (H,)),
        )
        qkv = _matrix(store, f"{p}.attn.qkv.weight", (3 * H, H))
        qkv_b = store.vector(f"{p}.attn.qkv.bias", (3 * H,))
        # bf16: one matmul for q | k | v, the bias added by the attention's packing
        self.qkv_fused = Linear(qkv, np.ascontiguousarray(qkv_b, dtype=np.float32))
        # q, k and v as three row ranges of the fused weight: three contiguous outputs
        self.qkv = [
            Linear(
                Weight(qkv.fmt, qkv.data[i * H : (i + 1) * H], (H, H)),
                qkv_b[i * H : (i + 1) * H].copy(),
            )
            for i in range(3)
        ]
        self.proj = _linear(store, f"{p}.attn.proj", H, H)
        self.fc1 = _linear(store, f"{p}.mlp.linear_fc1", I, H)
        self.fc2 = _linear(store, f"{p}.mlp.linear_fc2", H, I)
        self.n_heads, self.head_dim = cfg.num_heads, cfg.head_dim

    def linears(self, bf16: bool) -> list[Linear]:
        """The block's matmuls in one dtype's form (bf16: q, k, v fused)."""
        return [*([self.qkv_fused] if bf16 else self.qkv), self.proj, self.fc1, self.fc2]

    def __call__(self, h: np.ndarray, rope, segments, threads: int, clock=_NO_CLOCK) -> None:
        """h (N, H) updated in place; rope: [(positions, inv_freq)] per call of the rope
        kernel (f32), or (cos, sin) tables (N, head_dim / 2) (bf16: the fused qkv set);
        segments: (start, end) row ranges attending among themselves (images)."""
        x = layer_norm(h, *self.norm1, threads)
        clock.lap("layernorm")
        if self.qkv_fused.bf16:
            att = self._attention_bf16(x, rope, segments, threads, clock)
        else:
            att = self._attention_f32(x, rope, segments, threads, clock)
        K.residual_add(h, self.proj.matmul(att, threads), self.proj.b, threads)
        clock.lap("proj")
        x = layer_norm(h, *self.norm2, threads)
        clock.lap("layernorm")
        y = self.fc1.matmul(x, threads)
        clock.lap("fc1")
        K.bias_act(y, self.fc1.b, "gelu_tanh", threads)
        clock.lap("gelu")
        K.residual_add(h, self.fc2.matmul(y, threads), self.fc2.b, threads)
        clock.lap("fc2")

    def _attention_bf16(self, x, rope, segments, threads, clock) -> np.ndarray:
        """attn(x) before proj: one fused qkv matmul, then per segment the bf16 attention
        kernel (bias and rotation applied in its packing)."""
        qkv = self.qkv_fused.matmul(x, threads)
        clock.lap("qkv")
        cos, sin = rope
        att = np.empty((x.shape[0], self.n_heads * self.head_dim), np.float32)
        for a, b in segments:
            K.attention_bf16(
                qkv[a:b],
                self.qkv_fused.b,
                cos[a:b],
                sin[a:b],
                self.n_heads,
                self.head_dim,
                float(self.head_dim) ** -0.5,
                att[a:b],
                threads,
            )
        clock.lap("attention")
        return att

    def _attention_f32(self, x, rope, segments, threads, clock) -> np.ndarray:
        """attn(x) before proj, the exact float path."""
        N = x.shape[0]
        q, k, v = (lin(x, threads) for lin in self.qkv)
        clock.lap("qkv")
        q3 = q.reshape(N, self.n_heads, self.head_dim)
        k3 = k.reshape(N, self.n_heads, self.head_dim)
        for pos, inv in rope:
            K.rope(q3, pos, inv, 1.0, threads)
            K.rope(k3, pos, inv, 1.0, threads)
        clock.lap("rope")
        att = np.empty_like(q)
        for a, b in segments:
            att[a:b] = full_attention(q[a:b], k[a:b], v[a:b], self.n_heads, self.head_dim, threads)
        clock.lap("attention")
        return att


class Merger:
    """LN, 2x2 patches concatenated, fc1, GELU (exact), fc2 into the decoder width."""

    def __init__(self, cfg: VisionConfig, store, p: str, postshuffle: bool):
        H = cfg.hidden_size
        M = H * cfg.spatial_merge_size**2
        n = M if postshuffle else H
        self.postshuffle, self.M = postshuffle, M
        self.norm = (store.vector(f"{p}.norm.weight", (n,)), store.vector(f"{p}.norm.bias", (n,)))
        self.fc1 = _linear(store, f"{p}.linear_fc1", M, M)
        self.fc2 = _linear(store, f"{p}.linear_fc2", cfg.out_hidden_size, M)

    def __call__(self, h: np.ndarray, threads: int) -> np.ndarray:
        if self.postshuffle:
            x = layer_norm(h.reshape(-1, self.M), *self.norm, threads)
        else:
            x = layer_norm(h, *self.norm, threads).reshape(-1, self.M)
        return self.fc2(self.fc1(x, threads, "gelu_erf"), threads)


class VisionTower:
    """The vision encoder of a Qwen3-VL checkpoint; `encode` runs it on preprocessed
    images."""

    def __init__(self, cfg: VisionConfig, store, threads: int, dtype: str = "f32"):
        self.cfg, self.threads = cfg, int(threads or 0)
        self.dtype = "f32"
        H = cfg.hidden_size
        p = PREFIX
        pe = _matrix(
            store,
            f"{p}.patch_embed.proj.weight",
            (H, cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size),
        )
        self.patch_embed = Linear(pe, store.vector(f"{p}.patch_embed.proj.bias", (H,)))
        P = cfg.num_position_embeddings
        self.side = int(P**0.5)
        self.pos_embed = _matrix(store, f"{p}.pos_embed.weight", (P, H))
        self.blocks = [Block(cfg, store, f"{p}.blocks.{i}") for i in range(cfg.depth)]
        self.merger = Merger(cfg, store, f"{p}.merger", False)
        self.deepstack = [
            Merger(cfg, store, f"{p}.deepstack_merger_list.{j}", True)
            for j in range(len(cfg.deepstack_visual_indexes))
        ]
        hd = cfg.head_dim
        # axial RoPE: inv_freq over head_dim / 2, used for rows then for columns
        base = np.float32(cfg.rope_theta)
        exps = np.arange(0, hd // 2, 2, dtype=np.int64).astype(np.float32) / np.float32(hd // 2)
        inv = (np.float32(1.0) / (base**exps)).astype(np.float32)  # (hd / 4,)
        zero = np.zeros_like(inv)
        self.inv_rows = np.concatenate([inv, zero])  # (hd / 2,)
        self.inv_cols = np.concatenate([zero, inv])
        self.set_dtype(dtype)

    def linears(self) -> list[Linear]:
        """Every matmul of the tower in its current dtype's form (bf16: q, k, v fused)."""
        out = [self.patch_embed]
        for blk in self.blocks:
            out += blk.linears(self.dtype == "bf16")
        for mg in [self.merger, *self.deepstack]:
            out += [mg.fc1, mg.fc2]
        return out

    def set_dtype(self, dtype: str) -> str:
        """Run in `dtype` from now on ("auto", "f32" or "bf16", `resolve_dtype`); returns the
        resolved one. bf16: every weight converted to bf16 (kept; a bf16 file's weights are
        used as they lie), ~1e-2 relative error in the embeddings; f32: exact. The bf16
        attention takes heads of at most 128: larger ones make auto f32, bf16 an error."""
        asked, dtype = dtype, resolve_dtype(dtype)
        if dtype == "bf16" and self.cfg.head_dim > 128:
            if asked != "auto":
                raise KestrelError(
                    f"--vision-dtype bf16: head size {self.cfg.head_dim} is over the bf16 "
                    f"attention's 128; use --vision-dtype f32"
                )
            dtype = "f32"
        for blk in self.blocks:
            for lin in [*blk.linears(True), *blk.qkv]:
                lin.w16 = None
        self.dtype = dtype
        for lin in self.linears():
            lin.w16 = to_bf16(lin.w) if dtype == "bf16" else None
        return dtype

    def _rope_tables(self, rows: np.ndarray, cols: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """cos and sin (N, head_dim / 2) of the 2-D rotary angles, float32: the first
        quarter of the dims by the patch row, the rest by its column (the same angles
        as the two rope kernel calls of the float path)."""
        ang = rows.astype(np.float32)[:, None] * self.inv_rows[None, :]
        ang += cols.astype(np.float32)[:, None] * self.inv_cols[None, :]
        ang = ang.astype(np.float64)
        return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    @staticmethod
    def check_tensors(store) -> bool:
        """Whether the checkpoint has a vision tower."""
        return f"{PREFIX}.patch_embed.proj.weight" in store

    def encode(
        self, patches: np.ndarray, grids, clock: PartClock | None = None
    ) -> tuple[np.ndarray, list[np.ndarray]]:
        """Image embeddings of one or more images.

        Args:
            patches: float32 (sum of gh*gw, patch_dim), the images' patches one after the
                other (images.py's order).
            grids: [(t, gh, gw)] per image (t == 1: still images).
            clock: adds the wall time of each part to clock.parts (None: not timed).
        Returns:
            (embeds (sum of gh*gw/4, out_hidden), [deepstack features, same shape]).
        """
        cfg, threads = self.cfg, self.threads
        clock = clock if clock is not None else _NO_CLOCK
        m = cfg.spatial_merge_size
        h = self.patch_embed(np.ascontiguousarray(patches, dtype=np.float32), threads)
        clock.lap("patch_embed")
        rows, cols, segs, start = [], [], [], 0
        pos = []
        for t, gh, gw in grids:
            idx, wts = pos_embed_taps(gh, gw, self.side, m)
            # the 4 taps' weighted rows summed in tap order, one (N, H) table at a time
            pe = self.pos_embed.rows(idx[:, 0]) * wts[:, 0:1]
            for j in range(1, 4):
                pe += self.pos_embed.rows(idx[:, j]) * wts[:, j : j + 1]
            r, c = merge_order_coords(gh, gw, m)
            for _ in range(t):
                pos.append(pe)
                rows.append(r)
                cols.append(c)
                segs.append((start, start + gh * gw))
                start += gh * gw
        h += np.concatenate(pos)
        clock.lap("pos_embed")
        rows, cols = np.concatenate(rows), np.concatenate(cols)
        if self.dtype == "bf16":
            rope = self._rope_tables(rows, cols)
        else:
            rope = [
                (np.ascontiguousarray(rows), self.inv_rows),
                (np.ascontiguousarray(cols), self.inv_cols),
            ]
        feats = []
        for i, blk in enumerate(self.blocks):
            blk(h, rope, segs, threads, clock)
            if i in cfg.deepstack_visual_indexes:
                j = cfg.deepstack_visual_indexes.index(i)
                feats.append(self.deepstack[j](h, threads))
                clock.lap("mergers")
        emb = self.merger(h, threads)
        clock.lap("mergers")
        return emb, feats
