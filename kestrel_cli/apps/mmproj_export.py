"""`kestrel quantize --mmproj FILE`: a Qwen3-VL checkpoint's vision tower as llama.cpp's
mmproj GGUF, the file convert_hf_to_gguf.py --mmproj writes (models/mmproj.py reads it
and lists the layout).

What the converter does, done the same way: general.architecture "clip", general.type
"mmproj", clip.projector_type "qwen3vl_merger"; the Conv3d patch embedding as its two
temporal slices (v.patch_embd.weight and .weight.1), F32 but in an f16 file (F16); the
position table, every 1-D tensor and the norms F32; the other matrices in the file type
(f32, f16, bf16, q8_0), a matrix whose rows are not whole blocks of 32 F16 in a q8_0
file (the converter's fallback); gguf.quants for the conversion (llama.cpp's rounding).
Keys: the vision hyperparameters, image mean and std (preprocessor_config.json, else the
Qwen3-VL processor's), clip.use_gelu, the spatial merge size, the LayerNorm eps as the
converter writes it (the text model's rms_norm_eps) and which blocks feed a deepstack
merger. Streamed and atomic as gguf_export.write_gguf writes any GGUF.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import numpy as np

from kestrel_cli.apps.gguf_export import (
    PlanTensor,
    _sigterm_raises,
    _store_rows,
    chunk_values,
    export_summary,
    write_gguf,
)
from kestrel_cli.core.atomic import atomic_write
from kestrel_cli.core.errors import KestrelError, clip
from kestrel_cli.formats.weights import Weight
from kestrel_cli.models.mmproj import PATCH, PROJECTOR, tower_tensors
from kestrel_cli.models.qwen3_vl_vision import PREFIX, VisionConfig

MMPROJ_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "bf16": "MOSTLY_BF16", "q8_0": "MOSTLY_Q8_0"}
_SLICE = "@t"  # a plan part "<patch embedding>@t<k>": temporal slice k of the Conv3d


def gguf_name(hf: str, deepstack: list[int]) -> str:
    """The mmproj tensor name of a model.visual.* tensor (the patch weight: its slice 0)."""
    rest = hf[len(PREFIX) + 1 :]
    base, _, kind = rest.rpartition(".")
    if base == "patch_embed.proj":
        return PATCH if kind == "weight" else "v.patch_embd.bias"
    if rest == "pos_embed.weight":
        return "v.position_embd.weight"
    merger = {"merger.norm": "v.post_ln", "merger.linear_fc1": "mm.0", "merger.linear_fc2": "mm.2"}
    if base in merger:
        return f"{merger[base]}.{kind}"
    parts = base.split(".")
    if parts[0] == "blocks":
        block = {
            "norm1": "ln1",
            "norm2": "ln2",
            "attn.qkv": "attn_qkv",
            "attn.proj": "attn_out",
            "mlp.linear_fc1": "ffn_up",
            "mlp.linear_fc2": "ffn_down",
        }
        return f"v.blk.{parts[1]}.{block['.'.join(parts[2:])]}.{kind}"
    if parts[0] == "deepstack_merger_list":
        layer = deepstack[int(parts[1])]
        short = {"norm": "norm", "linear_fc1": "fc1", "linear_fc2": "fc2"}[parts[2]]
        return f"v.deepstack.{layer}.{short}.{kind}"
    raise KestrelError(f"{hf}: no place in an mmproj GGUF")


def tensor_type(name: str, shape, ftype: str) -> str:
    """The converter's type for mmproj tensor `name` in a file of type `ftype`."""
    if name.startswith(PATCH):
        return "F16" if ftype == "f16" else "F32"
    if len(shape) < 2 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return "F32"
    if name == "v.position_embd.weight":
        return "F32"
    t = ftype.upper()
    if t == "Q8_0" and shape[-1] % 32:
        return "F16"  # gguf.quants refuses partial blocks; the converter falls back
    return t


def mmproj_plan(vision: VisionConfig, ftype: str) -> list[PlanTensor]:
    """The mmproj GGUF's tensors, the patch weight split into its two temporal slices."""
    plan = []
    for hf, shape in tower_tensors(vision):
        name = gguf_name(hf, vision.deepstack_visual_indexes)
        if name == PATCH:
            H, C, T, p, _ = shape
            for k, suffix in enumerate(("", ".1")):
                out = (H, C, p, p)
                plan.append(PlanTensor(name + suffix, out, [(f"{hf}{_SLICE}{k}", shape)]))
            continue
        plan.append(PlanTensor(name, shape, [(hf, shape)]))
    for t in plan:
        t.qtype = tensor_type(t.name, t.shape, ftype)
    return plan


def _rows(store, threads: int):
    """gguf_export's RowSource over the checkpoint, plus the Conv3d's temporal slices."""
    plain = _store_rows(store, chunk_values(threads))

    def rows(name, shape, order):
        if _SLICE not in name:
            yield from plain(name, shape, order)
            return
        src, k = name.split(_SLICE)
        fmt, raw, full, _ = store.entries[src]
        H = full[0]
        w = Weight(fmt, raw.reshape(H, -1), (H, math.prod(full[1:]))).dequantize()
        yield np.ascontiguousarray(w.reshape(full)[:, :, int(k)].reshape(H, -1))

    return rows


def check_source(src, out, ftype: str):
    """(config, tensor store, VisionConfig) of Qwen3-VL checkpoint `src` whose tower can be
    written to `out` as an mmproj of type `ftype`, or one KestrelError (nothing written)."""
    from kestrel_cli.models.loader import _load_hf_dir, config_of

    src, out = Path(src).expanduser(), Path(out).expanduser()
    if ftype not in MMPROJ_TYPES:
        raise KestrelError(f"unknown mmproj type {ftype!r} (choose from {', '.join(MMPROJ_TYPES)})")
    if not src.is_dir():
        raise KestrelError(f"{src}: expected a Qwen3-VL checkpoint directory")
    if out.is_dir():
        raise KestrelError(f"{out} is a directory; give the .gguf file to write")
    if not out.parent.is_dir():
        raise KestrelError(f"{out.parent}: no such directory")
    raw, store, _tok = _load_hf_dir(src)
    cfg = config_of(raw, src / "config.json")
    if cfg.model_type != "qwen3_vl" or not cfg.vision_config:
        raise KestrelError(
            f"{src}: model_type {clip(repr(cfg.model_type), 40)} has no Qwen3-VL vision "
            f"tower to write as an mmproj"
        )
    vision = VisionConfig.from_hf(cfg.vision_config)
    want = tower_tensors(vision)
    for name, shape in want:
        store._get(name, shape)  # KestrelError: missing, shape, dtype
    extra = sorted(n for n in store.entries if n.startswith(PREFIX + ".") and n not in dict(want))
    if extra:
        raise KestrelError(
            f"{src}: tensor(s) {', '.join(clip(n) for n in extra[:3])} have no place in "
            f"Qwen3-VL's mmproj; not supported"
        )
    if vision.temporal_patch_size != 2:
        raise KestrelError(
            f"{src}: temporal_patch_size={vision.temporal_patch_size}; llama.cpp's mmproj "
            f"holds a Conv3d of 2 frames"
        )
    return cfg, store, vision


def write_mmproj(
    src,
    out,
    ftype: str = "f16",
    log: Callable[[str], None] | None = None,
    threads: int | None = None,
) -> dict:
    """Write the vision tower of Qwen3-VL checkpoint directory `src` as llama.cpp's mmproj
    GGUF `out` of type `ftype` (f32, f16, bf16, q8_0). Returns a summary dict."""
    import gguf

    from kestrel_cli.inference.engine import default_threads
    from kestrel_cli.models.images import ImageConfig

    cfg, store, vision = check_source(src, out, ftype)
    src, out = Path(src).expanduser(), Path(out).expanduser()
    threads = default_threads() if threads is None else threads
    image = ImageConfig.from_dir(src, cfg.vision_config)
    plan = mmproj_plan(vision, ftype)
    side = math.isqrt(vision.num_position_embeddings)

    def metadata(w):
        w.add_string("general.type", "mmproj")
        w.add_name(src.resolve().name)
        w.add_file_type(gguf.LlamaFileType[MMPROJ_TYPES[ftype]])
        w.add_quantization_version(gguf.GGML_QUANT_VERSION)
        w.add_bool("clip.has_vision_encoder", True)
        w.add_uint32("clip.vision.projection_dim", cfg.hidden_size)
        w.add_uint32("clip.vision.image_size", side * vision.patch_size)
        w.add_uint32("clip.vision.patch_size", vision.patch_size)
        w.add_uint32("clip.vision.embedding_length", vision.hidden_size)
        w.add_uint32("clip.vision.feed_forward_length", vision.intermediate_size)
        w.add_uint32("clip.vision.block_count", vision.depth)
        w.add_uint32("clip.vision.attention.head_count", vision.num_heads)
        w.add_array("clip.vision.image_mean", [float(x) for x in image.image_mean])
        w.add_array("clip.vision.image_std", [float(x) for x in image.image_std])
        w.add_string("clip.projector_type", PROJECTOR)
        w.add_bool("clip.use_gelu", True)
        w.add_uint32("clip.vision.spatial_merge_size", vision.spatial_merge_size)
        w.add_float32("clip.vision.attention.layer_norm_epsilon", float(cfg.rms_norm_eps))
        deep = set(vision.deepstack_visual_indexes)
        if deep:
            w.add_array("clip.vision.is_deepstack_layers", [i in deep for i in range(vision.depth)])

    with _sigterm_raises(out), atomic_write(out) as f:
        total = write_gguf(
            f, cfg, plan, _rows(store, threads), metadata, None, threads, arch="clip"
        )
    return export_summary(out, plan, ftype, total, "mmproj", log)
