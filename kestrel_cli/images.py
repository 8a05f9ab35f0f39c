"""Image input for Qwen3-VL: decoding and preprocessing exactly as the checkpoint's
processor does it (transformers' Qwen2VLImageProcessor, Pillow backend), without torch.

  decode       Pillow: a path, bytes or a data: URL is opened, its EXIF orientation applied
               and converted to RGB (transformers' load_image); a PIL image given directly
               is used as is, its alpha composited onto white (convert_to_rgb)
  resize       smart_resize: both sides multiples of patch_size * merge_size, the pixel
               count within [min_pixels, max_pixels] (preprocessor_config.json), the aspect
               ratio kept; Pillow bicubic
  normalise    x / 255 (float64, then float32), then (x - mean) / std in float32
  patches      (gh * gw, C * temporal_patch * patch * patch): merge_size x merge_size blocks
               of patches in raster order, each patch's values channel-major, the still
               frame repeated temporal_patch_size times
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import KestrelError

MAX_DECODE_PIXELS = 10_000 * 10_000      # refuse larger files before decoding them
MAX_TEXT_CHUNK = 1 << 20                  # PNG text chunks: one, and all of them together
MAX_TEXT_MEMORY = 8 << 20
MAX_PATCH = 1024                          # patch, temporal patch and merge sizes


@dataclass
class ImageConfig:
    """preprocessor_config.json (Qwen3-VL's published values as defaults)."""
    min_pixels: int = 65536
    max_pixels: int = 16777216
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple = (0.5, 0.5, 0.5)
    image_std: tuple = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True

    @classmethod
    def from_dir(cls, path: Path, vision: dict | None = None) -> "ImageConfig":
        """From a checkpoint directory's preprocessor_config.json; without one, the
        published Qwen3-VL values with the patch sizes of the vision config."""
        cfg = cls()
        vision = vision or {}
        cfg.patch_size = vision.get("patch_size", cfg.patch_size)
        cfg.temporal_patch_size = vision.get("temporal_patch_size", cfg.temporal_patch_size)
        cfg.merge_size = vision.get("spatial_merge_size", cfg.merge_size)
        f = Path(path) / "preprocessor_config.json" if path is not None else None
        if f is None or not f.is_file():
            cfg.check("vision_config")
            return cfg
        from .loader import read_json_object
        raw = read_json_object(f, 1 << 20)
        size = raw.get("size") or {}
        if not isinstance(size, dict):
            raise KestrelError(f"{f}: size={str(size)[:40]} is invalid (expected an object)")
        cfg.min_pixels = raw.get("min_pixels", size.get("shortest_edge", cfg.min_pixels))
        cfg.max_pixels = raw.get("max_pixels", size.get("longest_edge", cfg.max_pixels))
        for k in ("patch_size", "temporal_patch_size", "merge_size"):
            if k in raw:
                setattr(cfg, k, raw[k])
        for k in ("image_mean", "image_std"):
            if k in raw:
                v = raw[k]
                setattr(cfg, k, tuple(v) if isinstance(v, list) else (v,) * 3)
        for k in ("rescale_factor", "do_resize", "do_rescale", "do_normalize"):
            if k in raw:
                setattr(cfg, k, raw[k])
        resample = raw.get("resample", 3)
        if resample != 3:
            raise KestrelError(f"{f}: resample={resample} is not supported (only 3, bicubic)")
        cfg.check(f)
        return cfg

    def check(self, source) -> None:
        """Every size and constant in range (a zero patch size divides by zero, a huge one
        allocates without bound): one KestrelError naming `source` and the field."""
        def bad(name, why):
            v = getattr(self, name)
            raise KestrelError(f"{source}: {name}={str(v)[:40]} is invalid ({why})")
        for name in ("patch_size", "temporal_patch_size", "merge_size"):
            v = getattr(self, name)
            if type(v) is not int or not 1 <= v <= MAX_PATCH:
                bad(name, f"an integer in 1..{MAX_PATCH}")
        for name in ("min_pixels", "max_pixels"):
            v = getattr(self, name)
            if type(v) is not int or not 1 <= v <= MAX_DECODE_PIXELS:
                bad(name, f"an integer in 1..{MAX_DECODE_PIXELS}")
        if self.min_pixels > self.max_pixels:
            bad("min_pixels", f"more than max_pixels={self.max_pixels}")
        for name in ("image_mean", "image_std"):
            v = getattr(self, name)
            if (len(v) != 3 or any(isinstance(x, bool) or not isinstance(x, (int, float))
                                   or not math.isfinite(x) for x in v)):
                bad(name, "three finite numbers")
        if 0 in self.image_std:
            bad("image_std", "a zero divides by zero")
        r = self.rescale_factor
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
            bad("rescale_factor", "a finite number")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """transformers' smart_resize: (h, w) multiples of factor, pixels within the bounds,
    aspect ratio kept as closely as possible."""
    if height < 1 or width < 1:
        raise KestrelError(f"image of {width}x{height} pixels is empty")
    if max(height, width) / min(height, width) > 200:
        raise KestrelError(f"image aspect ratio {max(height, width) / min(height, width):.0f} "
                           f"is over 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


@dataclass
class ImageInput:
    """One preprocessed image."""
    patches: np.ndarray           # float32 (gh * gw, patch_dim)
    grid: tuple[int, int, int]    # (t, gh, gw) in patches
    digest: str                   # of the pixel values (cache keys)
    merge: int

    @property
    def n_tokens(self) -> int:
        t, gh, gw = self.grid
        return t * gh * gw // (self.merge * self.merge)


def _pil():
    try:
        from PIL import Image, ImageFile, ImageOps, PngImagePlugin
    except ImportError:
        raise KestrelError("image input needs Pillow: pip install pillow") from None
    # Pillow's limits, set here rather than trusted as defaults: a file over MAX_DECODE_PIXELS
    # is refused from its header (DecompressionBombWarning made an error below), a truncated
    # file is an error (not padded with grey), PNG text chunks are bounded
    Image.MAX_IMAGE_PIXELS = MAX_DECODE_PIXELS
    ImageFile.LOAD_TRUNCATED_IMAGES = False
    PngImagePlugin.MAX_TEXT_CHUNK = MAX_TEXT_CHUNK
    PngImagePlugin.MAX_TEXT_MEMORY = MAX_TEXT_MEMORY
    return Image, ImageOps


def _describe(src) -> str:
    if isinstance(src, (bytes, bytearray)):
        return f"image ({len(src)} bytes)"
    s = str(src)
    return "image data: URL" if s.startswith("data:") else s


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 data: URL (data:image/png;base64,...)."""
    head, _, data = url.partition(",")
    if not head.startswith("data:") or ";base64" not in head or not data:
        raise KestrelError("image data: URL must be base64 (data:image/...;base64,...)")
    try:
        return base64.b64decode(data, validate=False)
    except (binascii.Error, ValueError) as e:
        raise KestrelError(f"image data: URL is not valid base64 ({e})") from None


def load_image(src):
    """A PIL RGB image from a path, bytes, a data: URL or a PIL image (see module doc)."""
    Image, ImageOps = _pil()
    if isinstance(src, Image.Image):
        img = src
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            img = img.convert("RGBA")
            white = Image.new("RGBA", img.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, img).convert("RGB")
        return img.convert("RGB")
    if isinstance(src, str) and src.startswith(("http://", "https://")):
        raise KestrelError(f"remote image URLs are not fetched ({src[:60]}): give a file "
                           f"path or a data: URL")
    if isinstance(src, str) and src.startswith("data:"):
        src = decode_data_url(src)
    if isinstance(src, (bytes, bytearray)):
        fp = io.BytesIO(bytes(src))
    elif isinstance(src, (str, os.PathLike)):
        p = Path(src).expanduser()
        if not p.is_file():
            raise KestrelError(f"image {src}: no such file")
        fp = p
    else:
        raise KestrelError(f"image must be a path, bytes, a data: URL or a PIL image, got "
                           f"{type(src).__name__}")
    import warnings
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = Image.open(fp)                     # reads the header only
            if img.size[0] * img.size[1] > MAX_DECODE_PIXELS:
                raise Image.DecompressionBombError
            if img.size[0] < 1 or img.size[1] < 1:
                raise ValueError(f"{img.size[0]}x{img.size[1]} pixels")
            img = ImageOps.exif_transpose(img)
            return img.convert("RGB")
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise KestrelError(f"{_describe(src)}: too large (more than {MAX_DECODE_PIXELS} "
                           f"pixels)") from None
    except MemoryError:
        raise KestrelError(f"{_describe(src)}: too large to decode (out of memory)") from None
    except Exception as e:     # a foreign file meets Pillow's decoders: any of their errors
        raise KestrelError(f"{_describe(src)}: not a readable image "
                           f"({type(e).__name__}: {' '.join(str(e).split())[:200]})") from None


def preprocess(img, cfg: ImageConfig) -> ImageInput:
    """An RGB PIL image -> its patches and grid, as the processor computes them."""
    Image, _ = _pil()
    w0, h0 = img.size
    if cfg.do_resize:
        h, w = smart_resize(h0, w0, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    else:
        h, w = h0, w0
    if (h, w) != (h0, w0) or cfg.do_resize:
        img = img.resize((w, h), resample=Image.BICUBIC)
    x = np.asarray(img)                                  # (h, w, 3) uint8
    if cfg.do_rescale:
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    else:
        x = x.astype(np.float32)
    if cfg.do_normalize:
        mean = np.array(cfg.image_mean, dtype=np.float32)
        std = np.array(cfg.image_std, dtype=np.float32)
        x = (x - mean) / std
    x = np.ascontiguousarray(x.transpose(2, 0, 1))       # (C, h, w)
    C = x.shape[0]
    ps, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = h // ps, w // ps
    if gh % m or gw % m:
        raise KestrelError(f"image of {w}x{h} pixels is not whole {m}x{m} blocks of "
                           f"{ps}-pixel patches (do_resize is off?)")
    p = x.reshape(C, gh // m, m, ps, gw // m, m, ps).transpose(1, 4, 2, 5, 0, 3, 6)
    p = np.broadcast_to(p[:, :, :, :, :, None], (*p.shape[:5], tp, ps, ps))
    patches = np.ascontiguousarray(p.reshape(gh * gw, C * tp * ps * ps), dtype=np.float32)
    digest = hashlib.sha1(patches.tobytes()).hexdigest()[:16] + f"-{gh}x{gw}"
    return ImageInput(patches, (1, gh, gw), digest, m)
