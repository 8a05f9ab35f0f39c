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

Hostile input: `probe_image` reads a file's header only (format, width, height) and refuses
what would be refused later without decoding a pixel: a format other than PNG, JPEG, WebP,
GIF and BMP (Pillow's other plugins are never called: the five are opened by their own
classes, not through Image.open's registry), an empty image, more than MAX_DECODE_PIXELS
pixels, an aspect ratio over MAX_ASPECT_RATIO. With `ImageConfig.tokens_for`,
`decode_cost` and `patch_bytes` a caller sizes an image (context, memory) from its header
alone; `load_image` probes first; `prepare` decodes and preprocesses one image keeping
only what the next step needs. Errors are one line, without heap addresses.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.core.osmem import return_freed_memory

# Refuse larger files before decoding them. 8192 x 8192 = 67.1 M pixels: phone photos (12 to
# 50 MP, 8160 x 6120) pass; Qwen3-VL resizes anything over max_pixels = 16.8 M down anyway,
# so more pixels only cost memory (decode_cost: 8 to 16 bytes a source pixel while decoding,
# 0.5 to 1.1 GB at the cap; the old 100 M cap let the 81 M pixel PNG bomb decode).
MAX_DECODE_PIXELS = 8192 * 8192
# transformers' smart_resize raises "absolute aspect ratio must be smaller than 200" past
# max(h, w) / min(h, w) > 200: refused from the header, before the decode it would follow
MAX_ASPECT_RATIO = 200
# Images in one prompt. Each costs a header probe, a decode and a vision tower pass however
# few tokens it has (Qwen3-VL: at least 64 tokens, min_pixels 65536 / 32^2, + 2 delimiters):
# 32 small images fill half of the CLI's default 4096-token context; a client with more
# (and a larger context) sends them in several prompts.
MAX_IMAGES_PER_PROMPT = 32
# preprocess normalises this many pixels at a time (whole merge blocks of rows, at least
# one): its float64/float32 temporaries stay a few MB instead of 36 bytes a pixel
BAND_PIXELS = 1 << 16
ACCEPTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
# Peak bytes a source pixel while decoding to RGB (ImageConfig.decode_cost), measured on
# Pillow 13 at 50 MP; "PIL" (an image given decoded: RGBA composite) and unknown: the most
DECODE_BYTES = {"PNG": 8, "GIF": 8, "BMP": 8, "JPEG": 12, "WEBP": 16, "PIL": 16}
_FORMAT_NAMES = "PNG, JPEG, WebP, GIF or BMP"
MAX_TEXT_CHUNK = 1 << 20  # PNG text chunks: one, and all of them together
MAX_TEXT_MEMORY = 8 << 20
MAX_PATCH = 1024  # patch, temporal patch and merge sizes


@dataclass(frozen=True)
class ImageHeader:
    """What an image file's header says: its format (one of ACCEPTED_FORMATS; "PIL" for an
    image given decoded) and size as stored (an EXIF rotation may swap width and height
    once decoded; tokens_for, decode_cost and patch_bytes are the same either way)."""

    format: str
    width: int
    height: int


_SHARED_KEYS = (
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "rescale_factor",
    "do_resize",
    "do_rescale",
    "do_normalize",
)


def read_processor_config(cfg, path, vision: dict | None, name: str):
    """What Qwen3-VL's image and video processor configs share, into cfg (an ImageConfig or
    video.VideoConfig): the vision config's patch sizes, then from the JSON object
    path/name its patch sizes, mean / std, rescale and do_* flags. Returns (the object, its
    `size` object, the file) for the caller's own fields, or None without such a file; a
    `size` that is not an object or a resample other than bicubic is refused in one line."""
    vision = vision or {}
    cfg.patch_size = vision.get("patch_size", cfg.patch_size)
    cfg.temporal_patch_size = vision.get("temporal_patch_size", cfg.temporal_patch_size)
    cfg.merge_size = vision.get("spatial_merge_size", cfg.merge_size)
    f = Path(path) / name if path is not None else None
    if f is None or not f.is_file():
        return None
    from kestrel_cli.models.loader import read_json_object

    raw = read_json_object(f, 1 << 20)
    size = raw.get("size") or {}
    if not isinstance(size, dict):
        raise KestrelError(f"{f}: size={str(size)[:40]} is invalid (expected an object)")
    for k in _SHARED_KEYS:
        if k in raw:
            setattr(cfg, k, raw[k])
    for k in ("image_mean", "image_std"):
        if k in raw:
            v = raw[k]
            setattr(cfg, k, tuple(v) if isinstance(v, list) else (v,) * 3)
    resample = raw.get("resample", 3)
    if resample != 3:
        raise KestrelError(f"{f}: resample={resample} is not supported (only 3, bicubic)")
    return raw, size, f


def bad_field(cfg, source, name: str, why: str):
    """The KestrelError for cfg.name read from `source` (a config file's name)."""
    v = getattr(cfg, name)
    raise KestrelError(f"{source}: {name}={str(v)[:40]} is invalid ({why})")


def check_int_field(cfg, source, name: str, lo: int, hi: int, optional: bool = False) -> None:
    v = getattr(cfg, name)
    if optional and v is None:
        return
    if type(v) is not int or not lo <= v <= hi:
        bad_field(cfg, source, name, f"an integer in {lo}..{hi}")


def check_processor_fields(cfg, source, max_pixels: int, rescale_nonzero: bool = False) -> None:
    """The fields Qwen3-VL's image and video processor configs share (ImageConfig,
    video.VideoConfig): patch sizes, the pixel range, mean / std, rescale factor."""
    for name in ("patch_size", "temporal_patch_size", "merge_size"):
        check_int_field(cfg, source, name, 1, MAX_PATCH)
    for name in ("min_pixels", "max_pixels"):
        check_int_field(cfg, source, name, 1, max_pixels)
    if cfg.min_pixels > cfg.max_pixels:
        bad_field(cfg, source, "min_pixels", f"more than max_pixels={cfg.max_pixels}")
    for name in ("image_mean", "image_std"):
        v = getattr(cfg, name)
        if len(v) != 3 or any(
            isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x)
            for x in v
        ):
            bad_field(cfg, source, name, "three finite numbers")
    if 0 in cfg.image_std:
        bad_field(cfg, source, "image_std", "a zero divides by zero")
    r = cfg.rescale_factor
    if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r):
        bad_field(cfg, source, "rescale_factor", "a finite number")
    if rescale_nonzero and r == 0:
        bad_field(cfg, source, "rescale_factor", "a finite non-zero number")


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
        got = read_processor_config(cfg, path, vision, "preprocessor_config.json")
        if got is None:
            cfg.check("vision_config")
            return cfg
        raw, size, f = got
        cfg.min_pixels = raw.get("min_pixels", size.get("shortest_edge", cfg.min_pixels))
        cfg.max_pixels = raw.get("max_pixels", size.get("longest_edge", cfg.max_pixels))
        cfg.check(f)
        return cfg

    def check(self, source) -> None:
        """Every size and constant in range (a zero patch size divides by zero, a huge one
        allocates without bound): one KestrelError naming `source` and the field."""
        check_processor_fields(self, source, MAX_DECODE_PIXELS)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def resized(self, width: int, height: int) -> tuple[int, int]:
        """(h, w) an image of width x height is preprocessed at (KestrelError: empty, aspect
        ratio over the limit, or not whole merge blocks with do_resize off)."""
        if self.do_resize:
            return smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        if height % self.factor or width % self.factor:
            raise KestrelError(
                f"image of {width}x{height} pixels is not whole "
                f"{self.merge_size}x{self.merge_size} blocks of "
                f"{self.patch_size}-pixel patches (do_resize is off?)"
            )
        return height, width

    def tokens_for(self, width: int, height: int) -> int:
        """The tokens an image of width x height takes in a prompt (its ImageInput.n_tokens),
        from its size alone."""
        h, w = self.resized(width, height)
        return (h // self.patch_size) * (w // self.patch_size) // (self.merge_size**2)

    def patch_bytes(self, width: int, height: int) -> int:
        """Bytes of an image's preprocessed patches (float32, each pixel's 3 values repeated
        temporal_patch_size times): held until the prompt has been run."""
        h, w = self.resized(width, height)
        return h * w * 3 * self.temporal_patch_size * 4

    def decode_cost(self, width: int, height: int, format: str | None = None) -> int:
        """Upper estimate of the peak bytes `prepare` (load_image + preprocess) adds for one
        image of width x height in `format` (an ImageHeader's; None: the costliest), its
        patches included, the file's own bytes not. With N0 = width * height, N1 = w1 * h1
        the pixels after resizing and P = patch_bytes (Pillow keeps RGB and RGBA in 4
        bytes a pixel), the largest of
          decode      B * N0   the decoded image, the RGB conversion or EXIF rotation of it,
                               and the decoder's own buffers; B = DECODE_BYTES[format],
                               measured: PNG, GIF, BMP 4-8, progressive JPEG 10 (CMYK 12),
                               WebP 16 (libwebp's two RGBA canvases, then Pillow's copy)
          resize      4 N0 + 4 N1 + 4 w1 * height   source, result, and the horizontal
                               pass (new width x old height) before the vertical one
          patches     4 N1 + P + 43 * band   the resized image, the patches, one band's
                               pixels (crop, uint8) and float64/float32 temporaries
        plus 32 MiB (decoder and allocator slack). Peak RSS measured (Pillow 13, glibc) for
        1 to 50 MP PNG (RGB, RGBA, LA, 16-bit, a 49 MP bomb), JPEG (baseline, progressive,
        EXIF-rotated, CMYK), WebP, GIF, BMP, max_pixels 1 M and 16.8 M: 0.37 to 0.97 of
        this, the low end a baseline JPEG (B is the progressive CMYK one's);
        tests/test_images.py checks it stays under."""
        h1, w1 = self.resized(width, height)
        n0, n1 = width * height, h1 * w1
        band = max(BAND_PIXELS, w1 * self.factor)
        decode = DECODE_BYTES.get(format, max(DECODE_BYTES.values())) * n0
        resize = 4 * n0 + 4 * n1 + 4 * w1 * height
        patches = 4 * n1 + self.patch_bytes(width, height) + 43 * band
        return max(decode, resize, patches) + (32 << 20)


def smart_resize(
    height: int, width: int, factor: int, min_pixels: int, max_pixels: int
) -> tuple[int, int]:
    """transformers' smart_resize: (h, w) multiples of factor, pixels within the bounds,
    aspect ratio kept as closely as possible."""
    if height < 1 or width < 1:
        raise KestrelError(f"image of {width}x{height} pixels is empty")
    if max(height, width) / min(height, width) > 200:
        raise KestrelError(
            f"image aspect ratio {max(height, width) / min(height, width):.0f} is over 200"
        )
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

    patches: np.ndarray  # float32 (gh * gw, patch_dim)
    grid: tuple[int, int, int]  # (t, gh, gw) in patches
    digest: str  # of the pixel values (cache keys)
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


def _opener(fmt: str):
    """The Pillow class (JPEG: factory, which gives MPO for a multi-picture JPEG) that opens
    `fmt`: called directly, so no other plugin, nor one registered under these names by
    another library, ever sees the bytes."""
    from PIL import BmpImagePlugin, GifImagePlugin, JpegImagePlugin, PngImagePlugin, WebPImagePlugin

    return {
        "PNG": PngImagePlugin.PngImageFile,
        "JPEG": JpegImagePlugin.jpeg_factory,
        "WEBP": WebPImagePlugin.WebPImageFile,
        "GIF": GifImagePlugin.GifImageFile,
        "BMP": BmpImagePlugin.BmpImageFile,
    }[fmt]


def _sniff(head: bytes) -> str | None:
    """The accepted format whose signature `head` (a file's first bytes) starts with."""
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "PNG"
    if head.startswith(b"\xff\xd8\xff"):
        return "JPEG"
    if head.startswith(b"RIFF") and head[8:12] == b"WEBP":
        return "WEBP"
    if head[:6] in (b"GIF87a", b"GIF89a"):
        return "GIF"
    if head.startswith(b"BM"):
        return "BMP"
    return None


def _webp_size(head: bytes) -> tuple[int, int] | None:
    """A WebP's canvas size from its first 30 bytes: libwebp allocates the canvas when the
    file is opened, so the size is checked before Pillow opens it."""
    import struct

    kind = head[12:16]
    if kind == b"VP8 " and len(head) >= 30 and head[23:26] == b"\x9d\x01\x2a":
        w, h = struct.unpack("<HH", head[26:30])
        return w & 0x3FFF, h & 0x3FFF
    if kind == b"VP8X" and len(head) >= 30:
        return (
            int.from_bytes(head[24:27], "little") + 1,
            int.from_bytes(head[27:30], "little") + 1,
        )
    if kind == b"VP8L" and len(head) >= 25 and head[20] == 0x2F:
        bits = int.from_bytes(head[21:25], "little")
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    return None


def _describe(src) -> str:
    if isinstance(src, (bytes, bytearray)):
        return f"image ({len(src)} bytes)"
    s = str(src)
    return "image data: URL" if s.startswith("data:") else s


_ADDRESS = re.compile(r"<[^<>]*\bat 0x[0-9a-fA-F]+>|\b0x[0-9a-fA-F]{6,}\b")


def _reason(e: BaseException) -> str:
    """An exception as a short line: its type and message, no repr of a file object nor a
    heap address (Pillow writes "cannot identify image file <_io.BytesIO object at 0x...>")."""
    text = _ADDRESS.sub("(a buffer)", " ".join(str(e).split()))[:200]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _check_size(width: int, height: int, desc: str) -> None:
    """The header checks: not empty, at most MAX_DECODE_PIXELS, aspect within the limit."""
    if width < 1 or height < 1:
        raise KestrelError(f"{desc}: {width}x{height} pixels is empty")
    if width * height > MAX_DECODE_PIXELS:
        raise KestrelError(
            f"{desc}: {width}x{height} pixels is too large (more than {MAX_DECODE_PIXELS} pixels)"
        )
    ratio = max(width, height) / min(width, height)
    if ratio > MAX_ASPECT_RATIO:
        raise KestrelError(
            f"{desc}: {width}x{height} pixels has an aspect ratio of "
            f"{ratio:.0f}, over the image processor's limit of "
            f"{MAX_ASPECT_RATIO}"
        )


def _open(src):
    """(the opened, not decoded, PIL image, its ImageHeader) with every header check done; a
    PIL image given is checked and returned as is."""
    Image, _ = _pil()
    if isinstance(src, Image.Image):
        _check_size(*src.size, "image")
        return src, ImageHeader("PIL", *src.size)
    desc = _describe(src)
    if isinstance(src, str) and src.startswith(("http://", "https://")):
        raise KestrelError(
            f"remote image URLs are not fetched ({src[:60]}): give a file path or a data: URL"
        )
    if isinstance(src, str) and src.startswith("data:"):
        src = decode_data_url(src)
    if isinstance(src, (bytes, bytearray)):
        fp, head = io.BytesIO(bytes(src)), bytes(src[:32])
    elif isinstance(src, (str, os.PathLike)):
        fp = Path(src).expanduser()
        if not fp.is_file():
            raise KestrelError(f"image {src}: no such file")
        try:
            with open(fp, "rb") as f:
                head = f.read(32)
        except OSError as e:
            raise KestrelError(f"{desc}: cannot read it ({_reason(e)})") from None
    else:
        raise KestrelError(
            f"image must be a path, bytes, a data: URL or a PIL image, got {type(src).__name__}"
        )
    fmt = _sniff(head)
    if fmt is None:
        raise KestrelError(f"{desc}: not a readable image (not a {_FORMAT_NAMES} file)")
    if fmt == "WEBP" and (size := _webp_size(head)) is not None:
        _check_size(*size, desc)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            img = _opener(fmt)(fp)  # reads the header only
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise KestrelError(f"{desc}: too large (more than {MAX_DECODE_PIXELS} pixels)") from None
    except MemoryError:
        raise KestrelError(f"{desc}: too large to open (out of memory)") from None
    except Exception as e:  # a broken header meets the plugin's parser: any of its errors
        raise KestrelError(f"{desc}: not a readable image ({_reason(e)})") from None
    kind = "JPEG" if img.format == "MPO" else img.format  # MPO: a JPEG with more pictures
    try:
        if kind != fmt:
            raise KestrelError(f"{desc}: not a readable image (opened as {img.format})")
        _check_size(*img.size, desc)
    except KestrelError:
        img.close()
        raise
    return img, ImageHeader(fmt, *img.size)


def probe_image(src) -> ImageHeader:
    """An image's header: format, width, height, from a path, bytes, a data: URL or a PIL
    image, with no pixel decoded. KestrelError (one line) for anything `load_image` would
    refuse from the header: a format other than PNG, JPEG, WebP, GIF and BMP, an empty
    image, more than MAX_DECODE_PIXELS pixels, an aspect ratio over MAX_ASPECT_RATIO, a
    remote URL, a missing file."""
    img, header = _open(src)
    if img is not src:
        img.close()
    return header


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
    """A PIL RGB image from a path, bytes, a data: URL or a PIL image (see module doc); the
    header is checked (probe_image) before any pixel is decoded."""
    Image, ImageOps = _pil()
    img, _ = _open(src)
    if isinstance(src, Image.Image):
        if "A" in img.getbands() or img.info.get("transparency") is not None:
            img = img.convert("RGBA")
            white = Image.new("RGBA", img.size, (255, 255, 255, 255))
            return Image.alpha_composite(white, img).convert("RGB")
        return img.convert("RGB")
    desc = _describe(src)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            ImageOps.exif_transpose(img, in_place=True)  # the processor's pixels, no copy
            if img.mode == "RGB":
                return img
            rgb = img.convert("RGB")
        img.close()  # the decoded source goes now, not at its GC
        return rgb
    except MemoryError:
        img.close()
        raise KestrelError(f"{desc}: too large to decode (out of memory)") from None
    except Exception as e:  # a foreign file meets Pillow's decoders: any of their errors
        img.close()
        raise KestrelError(f"{desc}: not a readable image ({_reason(e)})") from None


def preprocess(img, cfg: ImageConfig) -> ImageInput:
    """An RGB PIL image -> its patches and grid, as the processor computes them."""
    return _patchify(_resize(img, cfg), cfg)


def prepare(src, cfg: ImageConfig) -> ImageInput:
    """load_image + preprocess for one image, each step's input dropped as soon as the next
    has its output (the decoded source before the patches are made): peak decode_cost."""
    img = load_image(src)
    return_freed_memory()  # a source converted to RGB, decoder buffers
    img = _resize(img, cfg)  # the decoded source is freed here
    return_freed_memory()  # it and the resize's intermediate
    return _patchify(img, cfg)


def _resize(img, cfg: ImageConfig):
    """smart_resize's size, Pillow bicubic (always, as the processor: same size is a copy)."""
    Image, _ = _pil()
    if cfg.do_resize:
        h, w = cfg.resized(*img.size)
        img = img.resize((w, h), resample=Image.BICUBIC)
    return img


def _patchify(img, cfg: ImageConfig) -> ImageInput:
    """A resized RGB PIL image -> ImageInput. The processor's arithmetic (x * rescale_factor
    in float64, then float32; (x - mean) / std in float32) is element by element, so it is
    done a band of merge-block rows at a time, straight into the patches: bit for bit the
    values of the whole image at once (tests/test_images.py), without the float64
    and float32 copies of the whole image (36 bytes a pixel) next to the patches. The pixels
    are read a band at a time too (np.asarray of the whole image joins tobytes' pieces:
    another 6 bytes a pixel, left in the heap once freed)."""
    w, h = img.size
    C = len(img.getbands())
    ps, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    if h % (ps * m) or w % (ps * m):
        raise KestrelError(
            f"image of {w}x{h} pixels is not whole {m}x{m} blocks of "
            f"{ps}-pixel patches (do_resize is off?)"
        )
    gh, gw = h // ps, w // ps
    out = np.empty((gh * gw, C * tp * ps * ps), dtype=np.float32)
    # block row r of the image is patches [r * gw * m, (r + 1) * gw * m): their values as
    # (block row, block col, row in block, col in block, C, t, y, x)
    view = out.reshape(gh // m, gw // m, m, m, C, tp, ps, ps)
    mean = np.array(cfg.image_mean, dtype=np.float32)
    std = np.array(cfg.image_std, dtype=np.float32)
    step = max(1, BAND_PIXELS // (w * ps * m))  # block rows a band
    for r0 in range(0, gh // m, step):
        r1 = min(gh // m, r0 + step)
        band = np.asarray(img.crop((0, r0 * ps * m, w, r1 * ps * m)))
        if cfg.do_rescale:
            f = band.astype(np.float64)
            f *= cfg.rescale_factor
            f = f.astype(np.float32)
        else:
            f = band.astype(np.float32)
        if cfg.do_normalize:
            f -= mean
            f /= std
        # (rows, w, C) -> (block row, block col, row in block, col in block, C, y, x)
        p = f.reshape(r1 - r0, m, ps, gw // m, m, ps, C).transpose(0, 3, 1, 4, 6, 2, 5)
        view[r0:r1] = p[:, :, :, :, :, None]  # the still frame, tp times
    digest = hashlib.sha1(out).hexdigest()[:16] + f"-{gh}x{gw}"  # no bytes copy
    return ImageInput(out, (1, gh, gw), digest, m)
