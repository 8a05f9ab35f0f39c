"""Qwen3-VL: the Qwen3 decoder under `model.language_model.*` (top-level lm_head), the
vision tower (`model.visual.*`, models/qwen3_vl_vision.py, loaded on the first image) and
interleaved M-RoPE.

M-RoPE: each token has three positions (t, h, w). Rotary frequency i of a head follows
h when i % 3 == 1 and i < 3 * mrope_section[1], w when i % 3 == 2 and i < 3 *
mrope_section[2], t otherwise (transformers' interleaved layout). Text tokens have
t = h = w, so a text-only prompt is plain 1-D RoPE with the same inv_freq (the fast path,
one rope call); only a forward pass with image tokens runs the three streams, as three rope
calls whose inv_freq keep only the frequencies of one stream (a zero frequency rotates by
exactly nothing, so every value is rotated once, by its own angle).

Positions (transformers' get_rope_index): text continues from the previous position; an
image of (gh, gw) patches, merged m x m, takes t = p, h = p + row, w = p + col over its
gh/m x gw/m tokens, and the text after it resumes at p + max(gh, gw) / m. A video is
positioned as one such image per temporal patch (each after its timestamp text: Qwen3-VL
has no temporal position within a video, its time is in the text). After the
prompt the position runs `rope_delta` = (last position + 1 - tokens) ahead of the token
count, which the engine keeps for the decode steps and later turns.

DeepStack: the vision tower's deepstack features j = 0, 1, ... are added to the hidden
states at the image tokens after decoder layer j.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.models import qwen3
from kestrel_cli.runtime import kernels as K


def mrope_axes(cfg) -> np.ndarray:
    """int (head_dim / 2,): the position stream (0 t, 1 h, 2 w) of each rotary frequency."""
    half = cfg.head_dim // 2
    sec = cfg.rope.get("mrope_section") or [half, 0, 0]
    axes = np.zeros(half, dtype=np.int64)
    i = np.arange(half)
    axes[(i % 3 == 1) & (i < 3 * sec[1])] = 1
    axes[(i % 3 == 2) & (i < 3 * sec[2])] = 2
    return axes


def rope_index(ids, vision_ids, grids) -> tuple[np.ndarray, int]:
    """(positions int64 (3, T), rope_delta) for a prompt whose vision tokens (ids in
    `vision_ids`, an int or a set) come in runs, one per entry of `grids`, in order: (t,
    lh, lw) in merged tokens, t * lh * lw tokens (an image: (1, gh/m, gw/m); a video: one
    (1, gh/m, gw/m) run per temporal patch, as transformers splits video_grid_thw)."""
    vision = {vision_ids} if isinstance(vision_ids, int) else set(vision_ids)
    ids = np.asarray(ids, dtype=np.int64)
    T = ids.shape[0]
    is_vision = np.isin(ids, list(vision))
    pos = np.empty((3, T), dtype=np.int64)
    cur, i, k = 0, 0, 0
    while i < T:
        if is_vision[i]:
            if k >= len(grids):
                raise KestrelError("more image or video tokens in the prompt than inputs")
            t, lh, lw = grids[k]
            n = t * lh * lw
            tt, hh, ww = np.meshgrid(np.arange(t), np.arange(lh), np.arange(lw), indexing="ij")
            pos[0, i : i + n] = tt.reshape(-1) + cur
            pos[1, i : i + n] = hh.reshape(-1) + cur
            pos[2, i : i + n] = ww.reshape(-1) + cur
            cur += max(lh, lw)
            i += n
            k += 1
        else:
            j = i
            while j < T and not is_vision[j]:
                j += 1
            pos[:, i:j] = np.arange(cur, cur + j - i)
            cur += j - i
            i = j
    return pos, int(pos.max()) + 1 - T if T else 0


@dataclass
class VisionInput:
    """What a forward pass adds for its image tokens."""

    rows: np.ndarray  # int64 (n,): the image tokens' rows in this call
    embeds: np.ndarray  # float32 (n, H): replace their token embeddings
    deepstack: list  # [float32 (n, H)]: added after decoder layer j


class Attention(qwen3.Attention):
    def __init__(self, cfg, store, p, norm):
        super().__init__(cfg, store, p, norm)
        inv_freq, self.attn_scale = cfg.rope_inv_freq()
        axes = mrope_axes(cfg)
        self.inv_axes = [
            np.where(axes == a, inv_freq, np.float32(0)).astype(np.float32) for a in range(3)
        ]

    def apply_rope(self, q, k, fwd):
        # differs from qwen3: (3, T) positions take one rope call per stream
        pos = fwd.positions
        if pos.ndim == 1:
            return super().apply_rope(q, k, fwd)
        for a in range(3):
            # the attention scaling (yarn) once: a zero frequency multiplies its pair by it
            scale = self.attn_scale if a == 0 else 1.0
            K.rope_unchecked(q, pos[a], self.inv_axes[a], scale, fwd.threads)
            K.rope_unchecked(k, pos[a], self.inv_axes[a], scale, fwd.threads)


class Model(qwen3.Model):
    prefix = "model.language_model"  # differs from qwen3: decoder nested under the VL wrapper
    attention_cls = Attention

    def __init__(self, cfg, store, threads=1, act="f32"):
        super().__init__(cfg, store, threads, act)
        self.store = store
        self._vision = [None]  # shared by Engine.fork's shallow copies
        # the vision tower's dtype as asked (qwen3_vl_vision.DTYPES; Engine.load sets it
        # from --vision-dtype before the tower loads, which resolves "auto")
        self.vision_dtype = "f32"

    @property
    def has_vision(self) -> bool:
        from kestrel_cli.models.qwen3_vl_vision import VisionTower

        return self.cfg.vision_config is not None and VisionTower.check_tensors(self.store)

    @property
    def vision_bits(self) -> int:
        """Width of the vision tower's matmul and attention operands: 16 (bf16) or 32."""
        tower = self._vision[0]
        return 16 if tower is not None and tower.dtype == "bf16" else 32

    @property
    def vision(self):
        """The vision tower, loaded on first use."""
        if self._vision[0] is None:
            from kestrel_cli.models.qwen3_vl_vision import VisionConfig, VisionTower

            if not self.has_vision:
                raise KestrelError(
                    "this checkpoint has no vision tower (model.visual.*): "
                    "images need a full Qwen3-VL checkpoint"
                )
            self._vision[0] = VisionTower(
                VisionConfig.from_hf(self.cfg.vision_config),
                self.store,
                self.threads,
                self.vision_dtype,
            )
        return self._vision[0]

    def __call__(
        self,
        ids,
        cache,
        all_logits=False,
        act=None,
        positions=None,
        vision: VisionInput | None = None,
    ):
        """As llama.Model, plus positions (3, T) for M-RoPE and the image tokens' inputs."""
        if positions is not None:
            positions = np.ascontiguousarray(positions, dtype=np.int64)  # rows contiguous
        return self.forward(ids, cache, all_logits, act, positions, vision)

    def add_inputs(self, h, vision: VisionInput | None) -> None:
        if vision is not None and len(vision.rows):
            h[vision.rows] = vision.embeds

    def after_layer(self, h, i: int, vision: VisionInput | None) -> None:
        if vision is not None and i < len(vision.deepstack) and len(vision.rows):
            h[vision.rows] += vision.deepstack[i]
