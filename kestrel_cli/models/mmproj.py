"""Qwen3-VL's vision tower from llama.cpp's mmproj GGUF (`--mmproj FILE`).

llama.cpp keeps a Qwen3-VL model in two files: the text decoder (arch qwen3vl, loader.py)
and `mmproj-*.gguf`, the vision tower as convert_hf_to_gguf.py --mmproj writes it:
general.architecture "clip", clip.projector_type "qwen3vl_merger", and

  v.patch_embd.weight, .weight.1   the Conv3d kernel (H, C, 2, p, p) as its two temporal
                                   slices (H, C, p, p), F32 (F16 in an f16 file); .bias
  v.position_embd.weight           the learned (S*S, H) position table, F32
  v.blk.{i}.ln1 / ln2              norm1 / norm2 (LayerNorm, F32)
  v.blk.{i}.attn_qkv, attn_out     attn.qkv (the fused (3H, H) weight as is), attn.proj
  v.blk.{i}.ffn_up, ffn_down       mlp.linear_fc1, mlp.linear_fc2
  v.post_ln                        merger.norm (over H, before the 2x2 merge)
  mm.0, mm.2                       merger.linear_fc1, merger.linear_fc2
  v.deepstack.{layer}.norm/fc1/fc2 deepstack_merger_list.{j} (j: the j-th deepstack layer)

matrices in the file type (F32, F16, BF16 or Q8_0; rows not whole blocks of 32: F16),
1-D tensors F32. Keys: clip.vision.{embedding_length, feed_forward_length, block_count,
attention.head_count, projection_dim (the decoder's width), patch_size, image_size,
spatial_merge_size, image_mean, image_std, is_deepstack_layers}, clip.use_gelu (the
blocks' tanh GELU). llama.cpp's own choices that transformers does not make are not
taken: its LayerNorm eps key holds the text model's rms_norm_eps (transformers' tower
uses 1e-6 whatever it says, as VisionTower does), and its 8..4096 image-token limits
differ from the Qwen3-VL processor's 65536..16777216 pixels, which Kestrel keeps so a
GGUF model sees an image as the safetensors checkpoint does.

`read_tower` checks a parsed mmproj (keys, tensor names, shapes, types) and returns the
tower's config.json-style vision_config and its tensors under their Hugging Face names;
`decoder_for_vision` turns the qwen3vl text GGUF's config into Qwen3-VL's (M-RoPE
sections, image token ids). loader.py reads the files; nothing here opens one but
`candidates`, which lists the mmproj files beside a model.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kestrel_cli.core.errors import KestrelError, clip
from kestrel_cli.formats.gguf_check import printable
from kestrel_cli.formats.weights import Weight
from kestrel_cli.models.qwen3_vl_vision import PREFIX, VisionConfig

PROJECTOR = "qwen3vl_merger"  # clip.projector_type of Qwen3-VL (gguf VisionProjectorType)
TYPES = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0"}
MAX_SIZE = 1 << 16  # widths, layer and head counts: far above any published tower
MAX_PATCH = 1024
PATCH = "v.patch_embd.weight"
# GGUF name in a block -> the Hugging Face name under model.visual.blocks.{i}
_BLOCK = {
    "ln1": "norm1",
    "ln2": "norm2",
    "attn_qkv": "attn.qkv",
    "attn_out": "attn.proj",
    "ffn_up": "mlp.linear_fc1",
    "ffn_down": "mlp.linear_fc2",
}
_MERGER = {"v.post_ln": "merger.norm", "mm.0": "merger.linear_fc1", "mm.2": "merger.linear_fc2"}
_DEEPSTACK = {"norm": "norm", "fc1": "linear_fc1", "fc2": "linear_fc2"}


@dataclass
class VisionFile:
    """What a GGUF model's vision comes from: its mmproj file (None: none), a line for the
    user, why images are refused when they are, and the image settings of its keys."""

    path: Path | None = None
    note: str = ""
    refusal: str | None = None
    image: dict = field(default_factory=dict)  # images.ImageConfig fields


def candidates(model: Path) -> list[Path]:
    """The mmproj files beside `model` (llama.cpp's names: mmproj*.gguf, any case), sorted."""
    try:
        return sorted(
            f
            for f in Path(model).parent.iterdir()
            if f.name.lower().startswith("mmproj")
            and f.name.lower().endswith(".gguf")
            and f.is_file()
            and f.resolve() != Path(model).resolve()
        )
    except OSError:
        return []


def hf_name(gguf_name: str, deepstack: list[int]) -> str | None:
    """The Hugging Face name (model.visual.*) of a tower tensor, None for another name;
    `deepstack`: the blocks with a deepstack merger, in order."""
    if gguf_name in (PATCH, PATCH + ".1"):
        return None  # the two temporal slices become one tensor (read_tower)
    if gguf_name == "v.patch_embd.bias":
        return f"{PREFIX}.patch_embed.proj.bias"
    if gguf_name == "v.position_embd.weight":
        return f"{PREFIX}.pos_embed.weight"
    base, _, kind = gguf_name.rpartition(".")
    if kind not in ("weight", "bias"):
        return None
    if base in _MERGER:
        return f"{PREFIX}.{_MERGER[base]}.{kind}"
    m = re.fullmatch(r"v\.blk\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _BLOCK:
        return f"{PREFIX}.blocks.{int(m.group(1))}.{_BLOCK[m.group(2)]}.{kind}"
    m = re.fullmatch(r"v\.deepstack\.(\d+)\.(\w+)", base)
    if m and m.group(2) in _DEEPSTACK and int(m.group(1)) in deepstack:
        j = deepstack.index(int(m.group(1)))
        return f"{PREFIX}.deepstack_merger_list.{j}.{_DEEPSTACK[m.group(2)]}.{kind}"
    return None


def tower_tensors(v: VisionConfig) -> list[tuple[str, tuple[int, ...]]]:
    """(Hugging Face name, shape) of every tensor of a Qwen3-VL vision tower."""
    H, I, O = v.hidden_size, v.intermediate_size, v.out_hidden_size
    M = H * v.spatial_merge_size**2
    p = PREFIX
    out = [
        (
            f"{p}.patch_embed.proj.weight",
            (H, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
        ),
        (f"{p}.patch_embed.proj.bias", (H,)),
        (f"{p}.pos_embed.weight", (v.num_position_embeddings, H)),
    ]
    for i in range(v.depth):
        b = f"{p}.blocks.{i}"
        for name, shape in (
            ("norm1", (H,)),
            ("norm2", (H,)),
            ("attn.qkv", (3 * H, H)),
            ("attn.proj", (H, H)),
            ("mlp.linear_fc1", (I, H)),
            ("mlp.linear_fc2", (H, I)),
        ):
            out.append((f"{b}.{name}.weight", shape))
            out.append((f"{b}.{name}.bias", shape[:1]))
    mergers = [(f"{p}.merger", H)] + [
        (f"{p}.deepstack_merger_list.{j}", M) for j in range(len(v.deepstack_visual_indexes))
    ]
    for m, norm in mergers:
        for name, shape in (("norm", (norm,)), ("linear_fc1", (M, M)), ("linear_fc2", (O, M))):
            out.append((f"{m}.{name}.weight", shape))
            out.append((f"{m}.{name}.bias", shape[:1]))
    return out


def _bad(path: Path, why: str) -> KestrelError:
    return KestrelError(f"{path.name}: not a usable Qwen3-VL mmproj file ({why})")


def read_tower(path: Path, reader, text_hidden: int, n_deepstack: int | None):
    """(vision_config dict, [(hf name, fmt, raw, shape)], image settings dict) of a parsed
    mmproj GGUF (`reader`: a gguf.GGUFReader of it), or one KestrelError naming the file:
    not llama.cpp's multimodal projector, another projector than Qwen3-VL's, a key or
    tensor out of place, or a tower that does not fit the text model (`text_hidden`: its
    hidden size; `n_deepstack`: its qwen3vl.n_deepstack_layers, None when unsaid)."""

    def value(key, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except Exception as e:  # bad UTF-8 and the like
            raise _bad(path, f"metadata {key} is unreadable: {clip(e, 80)}") from None

    def integer(key, lo=1, hi=MAX_SIZE, default=None):
        v = value(key, default)
        if v is None:
            raise _bad(path, f"lacks the metadata key {key}")
        if type(v) is not int or not lo <= v <= hi:
            raise _bad(path, f"metadata {key}={clip(repr(v), 40)} is not an integer in {lo}..{hi}")
        return v

    arch = value("general.architecture")
    if arch != "clip":
        raise KestrelError(
            f"{path.name}: not an mmproj file (general.architecture {clip(repr(arch), 40)}; "
            f"llama.cpp's multimodal projectors are 'clip')"
        )
    proj = value("clip.vision.projector_type", value("clip.projector_type"))
    if proj != PROJECTOR:
        raise KestrelError(
            f"{path.name}: projector type {clip(repr(proj), 40)} is not Qwen3-VL's "
            f"({PROJECTOR!r}); Kestrel runs only Qwen3-VL's vision tower"
        )
    if value("clip.has_vision_encoder") is not True:
        raise _bad(path, "clip.has_vision_encoder is not true: it holds no vision encoder")
    if value("clip.use_gelu") is not True:
        raise _bad(path, "clip.use_gelu is not true: Qwen3-VL's blocks use GELU")
    if value("clip.use_silu") is True:
        raise _bad(path, "clip.use_silu is set: Qwen3-VL's blocks use GELU")

    H = integer("clip.vision.embedding_length")
    depth = integer("clip.vision.block_count")
    heads = integer("clip.vision.attention.head_count")
    proj_dim = integer("clip.vision.projection_dim")
    patch = integer("clip.vision.patch_size", hi=MAX_PATCH)
    merge = integer("clip.vision.spatial_merge_size", hi=16, default=2)
    if proj_dim != text_hidden:
        raise KestrelError(
            f"{path.name}: projects into {proj_dim} dims, the text model's hidden size is "
            f"{text_hidden}: not this model's vision tower"
        )
    tensors = {}
    for t in reader.tensors:
        if not t.name.isprintable():
            raise _bad(path, f"tensor {printable(t.name)} is not a tensor name")
        tname = t.tensor_type.name
        if tname not in TYPES:
            raise _bad(
                path,
                f"tensor {printable(t.name)} has type {tname}; supported: {', '.join(TYPES)}",
            )
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists ne0 first
        tensors[t.name] = (TYPES[tname], t.data, shape)

    deepstack = sorted(
        {int(m.group(1)) for n in tensors if (m := re.match(r"v\.deepstack\.(\d+)\.", n))}
    )
    flags = value("clip.vision.is_deepstack_layers")
    if flags is not None:
        if not isinstance(flags, list) or len(flags) != depth:
            raise _bad(path, f"clip.vision.is_deepstack_layers is not {depth} booleans")
        said = [i for i, f in enumerate(flags) if f is True]
        if said != deepstack:
            raise _bad(
                path,
                f"clip.vision.is_deepstack_layers names blocks {said[:8]}, "
                f"its deepstack tensors blocks {deepstack[:8]}",
            )
    if any(i >= depth for i in deepstack):
        raise _bad(path, f"a deepstack merger after block {deepstack[-1]} of {depth}")
    if n_deepstack is not None and n_deepstack != len(deepstack):
        raise KestrelError(
            f"{path.name}: {len(deepstack)} deepstack mergers, the text model takes "
            f"{n_deepstack} (qwen3vl.n_deepstack_layers): not this model's vision tower"
        )

    for name in (PATCH, PATCH + ".1", "v.position_embd.weight", "v.blk.0.ffn_up.weight"):
        if name not in tensors:
            why = " (a Conv3d of 2 frames, as Qwen3-VL's)" if name == PATCH + ".1" else ""
            raise _bad(path, f"lacks tensor {name}{why}")
    pe_shape = tensors[PATCH][2]
    if len(pe_shape) != 4 or pe_shape[0] != H or pe_shape[2:] != (patch, patch):
        raise _bad(path, f"{PATCH} has shape {list(pe_shape)}, expected [{H}, C, {patch}, {patch}]")
    if tensors[PATCH + ".1"][2] != pe_shape:
        raise _bad(path, f"{PATCH}.1 has shape {list(tensors[PATCH + '.1'][2])}, not {PATCH}'s")
    n_pos = tensors["v.position_embd.weight"][2][0]
    side = math.isqrt(n_pos)
    if not 1 <= n_pos <= MAX_SIZE or side * side != n_pos:
        raise _bad(path, f"v.position_embd.weight has {n_pos} rows, not a square grid")
    try:
        cfg = VisionConfig.from_hf(
            dict(
                depth=depth,
                hidden_size=H,
                intermediate_size=tensors["v.blk.0.ffn_up.weight"][2][0],
                num_heads=heads,
                in_channels=pe_shape[1],
                patch_size=patch,
                spatial_merge_size=merge,
                temporal_patch_size=2,
                out_hidden_size=proj_dim,
                num_position_embeddings=n_pos,
                deepstack_visual_indexes=deepstack,
            )
        )
    except KestrelError as e:
        raise _bad(path, str(e)) from None
    ff = value("clip.vision.feed_forward_length")
    if ff is not None and ff != cfg.intermediate_size:
        raise _bad(
            path,
            f"clip.vision.feed_forward_length={clip(repr(ff), 24)}, its ffn_up has "
            f"{cfg.intermediate_size} rows",
        )

    out = [_patch_embedding(tensors[PATCH], tensors[PATCH + ".1"], H)]
    for name, (fmt, data, shape) in tensors.items():
        if name in (PATCH, PATCH + ".1"):
            continue
        hf = hf_name(name, deepstack)
        if hf is None:
            raise _bad(path, f"tensor {printable(name)} has no place in Qwen3-VL's tower")
        if len(shape) == 2:
            data = data.reshape(shape[0], -1)
        elif len(shape) != 1:
            raise _bad(path, f"tensor {printable(name)} has shape {list(shape)}")
        if fmt in ("f16", "bf16"):
            data = data.view(np.uint16)
        out.append((hf, fmt, data, shape))
    have = {hf: shape for hf, _, _, shape in out}
    want = tower_tensors(cfg)
    extra = sorted(set(have) - {hf for hf, _ in want})
    if extra:  # a block past block_count, say: the tower would run without it
        raise _bad(path, f"tensor of {extra[0]} has no place in a tower of {depth} blocks")
    for hf, shape in want:
        if hf not in have:
            raise _bad(path, f"lacks the tensor of {hf}")
        if have[hf] != shape:
            raise _bad(
                path, f"the tensor of {hf} has shape {list(have[hf])}, expected {list(shape)}"
            )

    image = dict(patch_size=patch, temporal_patch_size=2, merge_size=merge)
    for key, ours in (
        ("clip.vision.image_mean", "image_mean"),
        ("clip.vision.image_std", "image_std"),
    ):
        v = value(key)
        if v is not None:
            if not isinstance(v, list) or len(v) != 3:
                raise _bad(path, f"metadata {key} is not three numbers")
            image[ours] = tuple(v)
    vision = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    return vision, out, image


def _patch_embedding(first, second, H: int):
    """model.visual.patch_embed.proj.weight (H, C, 2, p, p) from the converter's two
    temporal slices (H, C, p, p), as a float32 copy (a few MB)."""
    (fmt, a, shape), (fmt1, b, _) = first, second
    n = math.prod(shape[1:])

    def f32(fmt_, raw):
        raw = raw.view(np.uint16) if fmt_ in ("f16", "bf16") else raw
        return Weight(fmt_, raw.reshape(H, -1), (H, n)).dequantize().reshape(shape)

    w = np.stack([f32(fmt, a), f32(fmt1, b)], axis=2)  # (H, C, 2, p, p)
    full = (shape[0], shape[1], 2, shape[2], shape[3])
    return f"{PREFIX}.patch_embed.proj.weight", "f32", np.ascontiguousarray(w.reshape(H, -1)), full


def decoder_for_vision(raw: dict, sections, tok, source: str) -> None:
    """The qwen3vl text GGUF's config (read as qwen3) made Qwen3-VL's, in place: M-RoPE
    from qwen3vl.rope.dimension_sections (interleaved, as transformers runs Qwen3-VL) and
    the image token ids from the vocabulary; KestrelError naming `source` when either is
    missing."""
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    if (
        not isinstance(sections, list)
        or len(sections) < 3
        or any(type(s) is not int or s < 0 for s in sections)
        or sum(sections[:3]) != head_dim // 2
        or any(sections[3:])
    ):
        raise KestrelError(
            f"{source}: qwen3vl.rope.dimension_sections={clip(repr(sections), 40)} is not "
            f"three counts of rotary pairs summing to {head_dim // 2} (head_dim / 2)"
        )
    ids = {}
    for token, key in (
        ("<|image_pad|>", "image_token_id"),
        ("<|vision_start|>", "vision_start_token_id"),
    ):
        i = tok.token_to_id(token)
        if i is None:
            raise KestrelError(f"{source}: the vocabulary has no {token} token (Qwen3-VL's images)")
        ids[key] = i
    rope = dict(raw.get("rope_scaling") or {})
    rope.setdefault("rope_type", "default")
    rope.update(mrope_section=list(sections[:3]), mrope_interleaved=True)
    raw.update(model_type="qwen3_vl", rope_scaling=rope, **ids)
