"""Hostile images (issue 33): every check that needs no pixels (format, size, aspect ratio,
token count) happens on the header, before anything is decoded; only PNG, JPEG, WebP, GIF
and BMP reach Pillow; errors are one line without heap addresses; preprocessing works in
row bands with the whole-image result bit for bit."""

from __future__ import annotations

import base64
import re
import struct
import subprocess
import sys
import tracemalloc
import zlib

import numpy as np
import pytest
from PIL import Image

from conftest import Decoded
from hostile_seeds import image_bytes, png_header_only
from kestrel_cli.core.errors import KestrelError
from kestrel_cli.models import images
from kestrel_cli.models.images import ImageConfig, load_image, preprocess

ACCEPTED = ["PNG", "JPEG", "WEBP", "GIF", "BMP"]


def _chunk(kind: bytes, body: bytes) -> bytes:
    return (
        struct.pack(">I", len(body))
        + kind
        + body
        + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    )


def png_bomb(width: int, height: int) -> bytes:
    """A complete, valid 1-bit grayscale PNG of zeros: 9000x9000 is ~10 KB on disk and 81 M
    pixels decoded (the issue's bomb)."""
    z = zlib.compressobj(9)
    row = b"\0" * (1 + (width + 7) // 8)  # filter byte + packed bits
    idat = b"".join(z.compress(row) for _ in range(height)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    )


def eps_bytes() -> bytes:
    """A minimal EPS file (Pillow would hand it to Ghostscript)."""
    return (
        b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 16 16\n%%EndComments\n"
        b"0 0 moveto 16 16 lineto stroke\nshowpage\n%%EOF\n"
    )


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64," + base64.b64encode(data).decode()


def one_line(fn) -> str:
    with pytest.raises(KestrelError) as e:
        fn()
    msg = str(e.value)
    assert msg and "\n" not in msg, msg
    assert not re.search(r"0x[0-9a-fA-F]{6,}| object at |BytesIO", msg), msg
    return msg


# ------------------------------------------------------------------ probe_image


@pytest.mark.parametrize("fmt", ACCEPTED)
def test_probe_reads_the_header_only(fmt, tmp_path, no_decoding):
    from kestrel_cli.models.images import ImageHeader, probe_image

    data = image_bytes(fmt, (40, 30), "L" if fmt == "GIF" else "RGB")
    f = tmp_path / f"x.{fmt.lower()}"
    f.write_bytes(data)
    for src in (data, data_url(data), str(f), f):
        h = probe_image(src)
        assert isinstance(h, ImageHeader) and (h.format, h.width, h.height) == (fmt, 40, 30)
    assert no_decoding == []


@pytest.mark.parametrize(
    "data,needle",
    [
        (png_bomb(9000, 9000), "too large"),  # 81 M pixels, 10 KB
        (png_header_only(1, 99_000_000), "too large"),  # the 1 x 99,000,000
        (png_bomb(1, 20_000), "aspect ratio"),  # 20,000 pixels, ratio 20,000
        (png_bomb(30_000, 100), "aspect ratio"),
        (png_header_only(0, 10), "image"),
    ],
    ids=["bomb-9000x9000", "1x99000000", "1x20000", "30000x100", "0x10"],
)
def test_probe_and_load_refuse_from_the_header(data, needle, no_decoding):
    from kestrel_cli.models.images import probe_image

    assert needle in one_line(lambda: probe_image(data))
    assert needle in one_line(lambda: load_image(data))
    assert needle in one_line(lambda: load_image(data_url(data)))
    assert no_decoding == []


def test_aspect_limit_is_the_processors(no_decoding):
    """transformers' smart_resize raises past a max/min side ratio of 200: 200 passes."""
    from kestrel_cli.models.images import probe_image

    assert probe_image(png_bomb(2000, 10)).width == 2000
    assert "aspect ratio" in one_line(lambda: probe_image(png_bomb(2010, 10)))


def test_decode_pixel_cap_covers_phone_photos():
    """50 MP phone photos load; the cap is well under the issue's 81 MP bomb."""
    assert 8160 * 6120 <= images.MAX_DECODE_PIXELS < 9000 * 9000


# ------------------------------------------------------------------ formats


@pytest.mark.parametrize("fmt", ["TIFF", "ICO", "PPM", "PCX", "TGA", "SGI", "EPS"])
def test_other_formats_refused_without_their_plugin(fmt, monkeypatch):
    """Only PNG, JPEG, WebP, GIF and BMP reach Pillow: another format's plugin never opens the
    file, even inside an image/png data URL; Image.open and its plugin registry are not used
    at all (a plugin another library registers under "PNG" is never called either)."""
    from PIL import EpsImagePlugin

    data = eps_bytes() if fmt == "EPS" else image_bytes(fmt, (16, 16))
    good = [image_bytes(ok, (8, 8), "L" if ok == "GIF" else "RGB") for ok in ACCEPTED]
    opened = []
    monkeypatch.setattr(
        EpsImagePlugin.EpsImageFile, "_open", lambda self: opened.append("EPS") or 1 / 0
    )

    def registry(*a, **k):
        raise Decoded("Image.open/init/preinit")

    for name in ("open", "init", "preinit"):
        monkeypatch.setattr(Image, name, registry)
    for src in (data, data_url(data)):
        assert "not a readable image" in one_line(lambda: load_image(src))
    assert opened == []
    for ok in good:  # the five open without the registry
        assert load_image(ok).size == (8, 8)


def test_errors_have_no_heap_address(tmp_path):
    good = image_bytes("PNG", (64, 64))
    for bad in (
        b"not a png at all",
        good[: len(good) // 2],
        eps_bytes(),
        good[:40] + b"\xff" * 200,
    ):
        one_line(lambda: load_image(bad))
        one_line(lambda: load_image(data_url(bad)))
        f = tmp_path / "bad.png"
        f.write_bytes(bad)
        one_line(lambda: load_image(str(f)))


# ------------------------------------------------------------------ tokens and cost


def picture(w, h, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB")


CONFIGS = [
    ImageConfig(),  # Qwen3-VL
    ImageConfig(min_pixels=3136, max_pixels=12845056, patch_size=14),  # Qwen2-VL
    ImageConfig(min_pixels=4096, max_pixels=12288),
    ImageConfig(
        min_pixels=256,
        max_pixels=4096,
        image_mean=(0.48, 0.45, 0.41),
        image_std=(0.27, 0.26, 0.28),
        do_rescale=False,
    ),
    ImageConfig(min_pixels=256, max_pixels=40000, do_normalize=False),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_tokens_for_matches_preprocess(cfg):
    for w, h in [(100, 70), (60, 130), (333, 517), (8, 1600), (1, 1), (700, 701)]:
        n = preprocess(picture(w, h), cfg).n_tokens
        assert cfg.tokens_for(w, h) == n and cfg.tokens_for(h, w) == n, (w, h)


def old_preprocess_patches(img, cfg: ImageConfig) -> np.ndarray:
    """preprocess as it was before the bands: the whole image at once (float64 rescale)."""
    w0, h0 = img.size
    h, w = images.smart_resize(h0, w0, cfg.factor, cfg.min_pixels, cfg.max_pixels)
    x = np.asarray(img.resize((w, h), resample=Image.BICUBIC))
    if cfg.do_rescale:
        x = (x.astype(np.float64) * cfg.rescale_factor).astype(np.float32)
    else:
        x = x.astype(np.float32)
    if cfg.do_normalize:
        x = (x - np.array(cfg.image_mean, np.float32)) / np.array(cfg.image_std, np.float32)
    x = np.ascontiguousarray(x.transpose(2, 0, 1))
    ps, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    gh, gw = h // ps, w // ps
    p = x.reshape(3, gh // m, m, ps, gw // m, m, ps).transpose(1, 4, 2, 5, 0, 3, 6)
    p = np.broadcast_to(p[:, :, :, :, :, None], (*p.shape[:5], tp, ps, ps))
    return np.ascontiguousarray(p.reshape(gh * gw, 3 * tp * ps * ps), dtype=np.float32)


@pytest.mark.parametrize("cfg", CONFIGS)
@pytest.mark.parametrize("band", [1, 5000, 1 << 30])
def test_banded_preprocess_is_bit_identical(cfg, band, monkeypatch):
    monkeypatch.setattr(images, "BAND_PIXELS", band)  # one block row .. the whole image
    for w, h in [(100, 70), (333, 517), (64, 2000)]:
        img = picture(w, h, seed=w)
        ours, ref = preprocess(img, cfg), old_preprocess_patches(img, cfg)
        assert ours.patches.dtype == np.float32 and ours.patches.flags.c_contiguous
        assert ours.patches.shape == ref.shape
        assert ours.patches.tobytes() == ref.tobytes()


def test_preprocess_peak_memory_is_its_output():
    """The float64 copy of the whole image (8 bytes a value), its float32 copies and a bytes
    copy of the patches were on top of the patches themselves."""
    cfg = ImageConfig(min_pixels=256, max_pixels=1 << 22)
    img = picture(1024, 768)
    tracemalloc.start()
    try:
        out = preprocess(img, cfg)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    pixels = out.patches.nbytes // (4 * 3 * cfg.temporal_patch_size)
    assert pixels == 1024 * 768
    assert peak < out.patches.nbytes + 3 * pixels + 8 * (1 << 20), (peak, out.patches.nbytes)


def test_decode_cost_bounds_grow_with_size():
    cfg = ImageConfig()
    small, photo, big = (
        cfg.decode_cost(640, 480),
        cfg.decode_cost(4000, 3000),
        cfg.decode_cost(8192, 8192),
    )
    assert 0 < small < photo < big
    # the preprocessed patches alone: 4 bytes x 3 channels x 2 frames a resized pixel
    assert photo >= 24 * 3968 * 2976 and big >= 24 * cfg.max_pixels


RSS_PROBE = """
import gc, sys
from kestrel_cli.models.images import ImageConfig, prepare, probe_image
def kib(key):
    return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith(key))
cfg = ImageConfig()
for path in sys.argv[1:]:
    data = open(path, "rb").read()
    head = probe_image(data)
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")        # VmHWM := VmRSS
    base = kib("VmRSS:")
    out = prepare(data, cfg)
    peak = (kib("VmHWM:") - base) * 1024
    print(peak, cfg.decode_cost(head.width, head.height, head.format), out.patches.nbytes)
    del out
"""


def test_decode_cost_bounds_measured_peak(tmp_path):
    """prepare's peak RSS, in a fresh process, stays under decode_cost: an RGBA PNG (the RGB
    conversion), a progressive JPEG (libjpeg's coefficients) with an EXIF rotation, a
    paletted GIF; and the patches are most of it."""
    rng = np.random.default_rng(0)
    w, h = 3000, 2000
    a = rng.integers(0, 256, (h // 8, w // 8, 4), dtype=np.uint8).repeat(8, 0).repeat(8, 1)
    files = [tmp_path / "a.png", tmp_path / "p.jpg", tmp_path / "g.gif"]
    Image.fromarray(a, "RGBA").save(files[0], compress_level=1)
    exif = Image.Exif()
    exif[0x0112] = 6
    Image.fromarray(a[..., :3], "RGB").save(
        files[1], quality=90, progressive=True, subsampling=0, exif=exif
    )
    Image.fromarray(a[..., 0], "L").convert("P").save(files[2])
    r = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, *map(str, files)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    for line, f in zip(r.stdout.splitlines(), files):
        peak, cost, patches = map(int, line.split())
        assert patches < peak <= cost, (f.name, peak, cost)
