"""Video input for Qwen3-VL: frames decoded with PyAV (FFmpeg), sampled, resized and cut
into patches as transformers' Qwen3VLVideoProcessor does, and the prompt text the
Qwen3VLProcessor writes for them.

  config       video_preprocessor_config.json; without one, Qwen3VLVideoProcessor's
               defaults (VideoConfig: 2 fps, 4..768 frames, t * h * w within 131072 and
               786432 pixels) with the vision config's patch sizes
  sampling     n = int(frames / fps * cfg.fps), clamped to [min_frames, max_frames] and to
               the frames the file has; indices = linspace(0, frames - 1, n).round()
               (num_frames in the config instead: that many, evenly spread)
  resize       the video's smart_resize: (h, w) multiples of patch_size * merge_size with
               t * h * w within [shortest_edge, longest_edge] (t: the sampled frames
               rounded to temporal pairs; cap_pixels_per_frame as the processor's option);
               each uint8 frame as torchvision's antialiased bicubic resize computes it on
               the CPU (`resize_bicubic_aa`: Pillow's filter and passes, with torch's int16
               fixed-point weights)
  normalise    float32 (x - mean / rescale) / (std / rescale): the processor's fused
               rescale-and-normalise, not the image path's x / 255 then (x - mean) / std
  patches      the frames padded to a multiple of temporal_patch_size with the last one;
               (t / tp * gh * gw, C * tp * ps * ps): per temporal pair, merge blocks in
               raster order, each patch channel-major then frame then row then column
  prompt       per temporal pair `<{t:.1f} seconds><|vision_start|>` + gh * gw / merge^2
               video tokens + `<|vision_end|>`, t the mean time of the pair's first and last
               frame (frame index / the stream's average frame rate); the template's own
               `<|vision_start|><|video_pad|><|vision_end|>` around the video is replaced

Hostile input: `probe_video` refuses from the file's size and its container header alone,
before a frame is decoded: more than MAX_VIDEO_BYTES, a container other than MP4/MOV,
Matroska/WebM and AVI (sniffed from the first bytes; FFmpeg is then told which demuxer to
use, so no other one reads the bytes), no video stream, a frame over MAX_FRAME_PIXELS or of
an aspect ratio over 200, more than MAX_SOURCE_FRAMES frames (counted from the packets when
the container does not say), fewer frames than a temporal patch, no frame rate. `plan` sizes
the sampled video (tokens, patch bytes) from the header; `prepare_video` decodes only up to
the last sampled frame and keeps only the sampled ones, resized. Errors are one line.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import math
import os
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.core.osmem import return_freed_memory
from kestrel_cli.models.images import (
    _reason,
    bad_field,
    check_int_field,
    check_processor_fields,
    read_processor_config,
)

# Files larger than this are refused before they are opened (the server's request body is
# bounded lower anyway, 32 MiB of JSON)
MAX_VIDEO_BYTES = 1 << 30
# A frame of more pixels is refused from the header: 8K UHD (7680 x 4320) passes; each
# frame is decoded (rgb24, 3 bytes a pixel) and dropped unless sampled
MAX_FRAME_PIXELS = 7680 * 4320
# Frames in the file: every frame up to the last sampled one is decoded, so this bounds the
# decoding work (one hour at 30 fps)
MAX_SOURCE_FRAMES = 108_000
MAX_FPS = 1000.0
MAX_ASPECT_RATIO = 200
# Videos in one prompt: each is a header probe, a decode and a vision tower pass of up to
# max_frames / 2 frame pairs
MAX_VIDEOS_PER_PROMPT = 4
# container -> (FFmpeg demuxer, name in messages)
CONTAINERS = {
    "MP4": ("mov", "MP4/MOV"),
    "MKV": ("matroska", "Matroska/WebM"),
    "AVI": ("avi", "AVI"),
}
_FORMAT_NAMES = "an MP4, MOV, WebM, MKV or AVI file"


def _av():
    try:
        import av
    except ImportError:
        raise KestrelError("video input needs PyAV: pip install av") from None
    return av


@dataclass(frozen=True)
class VideoHeader:
    """What a video's container says: its container (a CONTAINERS key), codec, frame size,
    frame count and average frame rate."""

    format: str
    codec: str
    width: int
    height: int
    frames: int
    fps: float


class _GridTokens:
    """The tokens of a (t, gh, gw) patch grid whose patches merge `merge` x `merge`."""

    grid: tuple
    merge: int

    @property
    def frame_tokens(self) -> int:
        return self.grid[1] * self.grid[2] // (self.merge * self.merge)

    @property
    def n_tokens(self) -> int:
        return self.grid[0] * self.frame_tokens


@dataclass
class VideoPlan(_GridTokens):
    """A video as it will be sampled and preprocessed, from its header alone."""

    indices: list  # source frame indices, in order (before the temporal padding)
    height: int  # resized frame size
    width: int
    grid: tuple  # (t, gh, gw): temporal pairs and patches
    timestamps: list  # seconds, one per temporal pair
    merge: int


@dataclass
class VideoInput(_GridTokens):
    """One preprocessed video: the vision tower's input and its prompt layout."""

    patches: np.ndarray  # float32 (t * gh * gw, patch_dim)
    grid: tuple  # (t, gh, gw)
    digest: str  # of the pixel values (cache keys)
    merge: int
    timestamps: list


@dataclass
class VideoConfig:
    """video_preprocessor_config.json (Qwen3VLVideoProcessor's defaults)."""

    min_pixels: int = 128 * 32 * 32  # size.shortest_edge: t * h * w at least
    max_pixels: int = 32 * 32 * 768  # size.longest_edge: t * h * w at most
    patch_size: int = 16
    temporal_patch_size: int = 2
    merge_size: int = 2
    image_mean: tuple = (0.5, 0.5, 0.5)
    image_std: tuple = (0.5, 0.5, 0.5)
    rescale_factor: float = 1 / 255
    do_resize: bool = True
    do_rescale: bool = True
    do_normalize: bool = True
    do_sample_frames: bool = True
    fps: float | None = 2
    num_frames: int | None = None
    min_frames: int = 4
    max_frames: int = 768
    cap_pixels_per_frame: bool = False
    max_video_tokens: int = 768

    @classmethod
    def from_dir(cls, path, vision: dict | None = None) -> "VideoConfig":
        """From a checkpoint directory's video_preprocessor_config.json; without one, the
        processor's defaults with the patch sizes of the vision config."""
        cfg = cls()
        got = read_processor_config(cfg, path, vision, "video_preprocessor_config.json")
        if got is None:
            cfg.check("vision_config")
            return cfg
        raw, size, f = got
        cfg.min_pixels = size.get("shortest_edge", cfg.min_pixels)
        cfg.max_pixels = size.get("longest_edge", cfg.max_pixels)
        for k in (
            "do_sample_frames",
            "fps",
            "num_frames",
            "min_frames",
            "max_frames",
            "cap_pixels_per_frame",
            "max_video_tokens",
        ):
            if k in raw:
                setattr(cfg, k, raw[k])
        cfg.cap_pixels_per_frame = bool(cfg.cap_pixels_per_frame)
        if cfg.num_frames is not None and raw.get("fps") is not None:
            raise KestrelError(f"{f}: num_frames and fps both set (the processor takes one)")
        if cfg.num_frames is not None:
            cfg.fps = None
        cfg.check(f)
        return cfg

    def check(self, source) -> None:
        """Every size and constant in range: one KestrelError naming `source` and the field."""
        check_processor_fields(self, source, 1 << 40, rescale_nonzero=True)
        for name in ("min_frames", "max_frames"):
            check_int_field(self, source, name, 1, 1 << 20)
        check_int_field(self, source, "num_frames", 1, 1 << 20, optional=True)
        check_int_field(self, source, "max_video_tokens", 1, 1 << 30)
        if self.min_frames > self.max_frames:
            bad_field(self, source, "min_frames", f"more than max_frames={self.max_frames}")
        if self.fps is not None and (
            isinstance(self.fps, bool)
            or not isinstance(self.fps, (int, float))
            or not 0 < self.fps <= MAX_FPS
        ):
            bad_field(self, source, "fps", f"a number in (0, {MAX_FPS:g}]")

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def sample(self, frames: int, fps: float) -> list[int]:
        """Qwen3VLVideoProcessor.sample_frames: the source frame indices to keep."""
        if not self.do_sample_frames:
            return list(range(frames))
        n = self.num_frames
        if n is None:
            n = int(frames / fps * self.fps)
            n = min(max(n, self.min_frames), self.max_frames, frames)
        return np.linspace(0, frames - 1, n).round().astype(int).tolist()

    def resized(self, n_frames: int, height: int, width: int) -> tuple[int, int]:
        """(h, w) the sampled frames are resized to (the video processor's smart_resize)."""
        if not self.do_resize:
            if height % self.factor or width % self.factor:
                raise KestrelError(
                    f"video frames of {width}x{height} pixels are not whole "
                    f"{self.merge_size}x{self.merge_size} blocks of {self.patch_size}-pixel "
                    f"patches (do_resize is off?)"
                )
            return height, width
        max_pixels = self.max_pixels
        if self.cap_pixels_per_frame:
            cap = self.max_video_tokens * self.factor * self.factor
            per_frame = max(min(cap, self.max_pixels // n_frames), int(self.min_pixels * 1.05))
            max_pixels = per_frame * n_frames
        return smart_resize(
            n_frames,
            height,
            width,
            self.temporal_patch_size,
            self.factor,
            self.min_pixels,
            max_pixels,
        )

    def plan(self, head: VideoHeader) -> VideoPlan:
        """The sampled frames, their size, grid and timestamps, from the header alone."""
        indices = self.sample(head.frames, head.fps)
        tp = self.temporal_patch_size
        if len(indices) < tp:
            raise KestrelError(
                f"video of {head.frames} frame(s): {len(indices)} sampled, fewer than the "
                f"{tp} of a temporal patch"
            )
        if not self.do_sample_frames and len(indices) > self.max_frames:
            raise KestrelError(
                f"video of {head.frames} frames, more than max_frames={self.max_frames} "
                f"(do_sample_frames is off)"
            )
        h, w = self.resized(len(indices), head.height, head.width)
        t = -(-len(indices) // tp)
        return VideoPlan(
            indices,
            h,
            w,
            (t, h // self.patch_size, w // self.patch_size),
            timestamps(indices, head.fps, tp),
            self.merge_size,
        )

    def patch_bytes(self, plan: VideoPlan) -> int:
        """Bytes of a video's patches (float32): held until the prompt has been run."""
        t, gh, gw = plan.grid
        return t * gh * gw * 3 * self.temporal_patch_size * self.patch_size**2 * 4

    def decode_cost(self, head: VideoHeader, plan: VideoPlan) -> int:
        """Upper estimate of the peak bytes `prepare_video` adds: FFmpeg's frame pool (up to
        20 decoded frames in flight, references and threads', at most 3 bytes a pixel), one
        rgb24 copy of a source frame, the resize's int32 sums and gathered taps (24 bytes a
        pixel of the horizontal pass's and of the output's), the resized uint8 frames kept,
        and the patches with one temporal pair's float32 temporaries; plus 64 MiB."""
        n0 = head.width * head.height
        n1 = plan.height * plan.width
        decode = 20 * 3 * n0 + 3 * n0 + 24 * head.height * max(plan.width, head.width) + 24 * n1
        kept = len(plan.indices) * 3 * n1
        patches = self.patch_bytes(plan) + 2 * self.temporal_patch_size * n1 * 3 * 4
        return decode + kept + patches + (64 << 20)


def smart_resize(
    n_frames: int, height: int, width: int, temporal: int, factor: int, min_pixels, max_pixels
) -> tuple[int, int]:
    """transformers' Qwen3-VL video smart_resize: frames smaller than `factor` scaled up
    first; (h, w) multiples of factor with t * h * w within the bounds (t: the frame count
    rounded to `temporal`), the aspect ratio kept as closely as possible."""
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > MAX_ASPECT_RATIO:
        raise KestrelError(
            f"video aspect ratio {max(height, width) / min(height, width):.0f} is over "
            f"{MAX_ASPECT_RATIO}"
        )
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(n_frames / temporal) * temporal
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((n_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (n_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def timestamps(indices, fps: float, temporal: int) -> list[float]:
    """Qwen3VLProcessor._calculate_timestamps: the indices padded to whole temporal patches
    with the last one, each patch's time the mean of its first and last frame's."""
    idx = list(indices)
    if len(idx) % temporal:
        idx += [idx[-1]] * (temporal - len(idx) % temporal)
    ts = [i / fps for i in idx]
    return [(ts[i] + ts[i + temporal - 1]) / 2 for i in range(0, len(ts), temporal)]


class _Taps:
    """One axis of an antialiased bicubic resize (in_size -> out_size) as torch computes it
    for uint8 (aten's _compute_index_ranges_weights + compute_index_ranges_int16_weights,
    the Pillow-SIMD scheme): per output index the first input index, and int16 weights of
    `precision` fractional bits over `k` taps (zero past the image)."""

    def __init__(self, in_size: int, out_size: int):
        scale = in_size / out_size
        support = 2.0 * scale if scale >= 1.0 else 2.0  # bicubic: interp_size 4
        k = int(math.ceil(support)) * 2 + 1
        inv = 1.0 / scale if scale >= 1.0 else 1.0
        xmin = np.empty(out_size, dtype=np.int64)
        w = np.zeros((out_size, k), dtype=np.float64)
        for i in range(out_size):
            center = scale * (i + 0.5)
            lo = max(int(center - support + 0.5), 0)
            size = min(int(center + support + 0.5), in_size) - lo
            x = np.abs((np.arange(size) + lo - center + 0.5) * inv)
            a = -0.5  # Keys' cubic as Pillow has it
            f = np.where(
                x < 1.0,
                ((a + 2) * x - (a + 3)) * x * x + 1,
                np.where(x < 2.0, ((a * x - 5 * a) * x + 8 * a) * x - 4 * a, 0.0),
            )
            total = f.sum()
            w[i, :size] = f / total if total != 0.0 else f
            xmin[i] = lo
        w_max = w.max()
        p = 0
        while p < 22 and int(0.5 + w_max * (1 << (p + 1))) < (1 << 15):
            p += 1
        v = w * (1 << p)
        self.weights = np.where(v < 0, v - 0.5, v + 0.5).astype(np.int64).astype(np.int32)
        # taps past the image have weight 0: read index 0 there
        idx = xmin[:, None] + np.arange(k)
        self.index = np.where(idx < in_size, idx, 0)
        self.precision = p


def resize_bicubic_aa(rgb: np.ndarray, h: int, w: int, taps: dict | None = None) -> np.ndarray:
    """uint8 (H, W, C) -> (h, w, C): torchvision's resize(..., BICUBIC, antialias=True) of a
    uint8 image on the CPU (torch's upsample_bicubic2d_aa uint8 kernel), bit for bit: the
    horizontal pass, rounded and clamped to uint8, then the vertical one; an axis of equal
    size is not resampled. `taps` caches the per-axis weights between frames."""
    taps = {} if taps is None else taps
    H, W = rgb.shape[:2]

    def axis(n_in, n_out):
        key = (n_in, n_out)
        if key not in taps:
            taps[key] = _Taps(n_in, n_out)
        return taps[key]

    def apply(x: np.ndarray, t: _Taps, along: int) -> np.ndarray:
        acc = np.full(
            x.shape[:along] + (t.index.shape[0],) + x.shape[along + 1 :],
            1 << (t.precision - 1) if t.precision else 0,
            dtype=np.int32,
        )
        for j in range(t.index.shape[1]):
            wj = t.weights[:, j]
            if not wj.any():
                continue
            src = np.take(x, t.index[:, j], axis=along).astype(np.int32)
            shape = [1] * x.ndim
            shape[along] = -1
            acc += src * wj.reshape(shape)
        acc >>= t.precision
        return np.clip(acc, 0, 255).astype(np.uint8)

    out = rgb
    if w != W:
        out = apply(out, axis(W, w), 1)
    if h != H:
        out = apply(out, axis(H, h), 0)
    return out


def placeholder(ts: float, start: str, pad: str, end: str) -> str:
    """One temporal patch's text as the processor writes it (one `pad`: the engine expands
    each to the frame's tokens after tokenising)."""
    return f"<{ts:.1f} seconds>{start}{pad}{end}"


# ------------------------------------------------------------------ reading the container


def _describe(src) -> str:
    if isinstance(src, (bytes, bytearray)):
        return f"video ({len(src)} bytes)"
    s = str(src)
    return "video data: URL" if s.startswith("data:") else f"video {s}"


def _sniff(head: bytes) -> str | None:
    """The accepted container whose signature `head` (a file's first bytes) has."""
    if head[4:8] in (b"ftyp", b"moov", b"mdat", b"free", b"wide", b"skip"):
        return "MP4"
    if head.startswith(b"\x1a\x45\xdf\xa3"):
        return "MKV"
    if head.startswith(b"RIFF") and head[8:12] == b"AVI ":
        return "AVI"
    return None


def decode_data_url(url: str) -> bytes:
    """The bytes of a base64 data: URL (data:video/mp4;base64,...), its size checked first."""
    head, _, data = url.partition(",")
    if not head.startswith("data:") or ";base64" not in head or not data:
        raise KestrelError("video data: URL must be base64 (data:video/...;base64,...)")
    if len(data) // 4 * 3 > MAX_VIDEO_BYTES:
        raise KestrelError(f"video data: URL is too large (more than {MAX_VIDEO_BYTES} bytes)")
    try:
        return base64.b64decode(data, validate=False)
    except (binascii.Error, ValueError) as e:
        raise KestrelError(f"video data: URL is not valid base64 ({e})") from None


def _source(src):
    """(a file path or BytesIO for av.open, its container kind, a description)."""
    desc = _describe(src)
    if isinstance(src, str) and src.startswith(("http://", "https://")):
        raise KestrelError(
            f"remote video URLs are not fetched ({src[:60]}): give a file path or a data: URL"
        )
    if isinstance(src, str) and src.startswith("data:"):
        src = decode_data_url(src)
    if isinstance(src, (bytes, bytearray)):
        if len(src) > MAX_VIDEO_BYTES:
            raise KestrelError(f"{desc}: too large (more than {MAX_VIDEO_BYTES} bytes)")
        fp, head = io.BytesIO(bytes(src)), bytes(src[:16])
    elif isinstance(src, (str, os.PathLike)):
        path = Path(src).expanduser()
        if not path.is_file():
            raise KestrelError(f"video {src}: no such file")
        try:
            size = path.stat().st_size
            if size > MAX_VIDEO_BYTES:
                raise KestrelError(
                    f"{desc}: {size} bytes is too large (more than {MAX_VIDEO_BYTES} bytes)"
                )
            with open(path, "rb") as f:
                head = f.read(16)
        except OSError as e:
            raise KestrelError(f"{desc}: cannot read it ({_reason(e)})") from None
        fp = str(path)
    else:
        raise KestrelError(f"video must be a path, bytes or a data: URL, got {type(src).__name__}")
    kind = _sniff(head)
    if kind is None:
        raise KestrelError(f"{desc}: not a readable video (not {_FORMAT_NAMES})")
    return fp, kind, desc


def _open(fp, kind: str, desc: str):
    """The opened container (its header read by the demuxer named for `kind`) and its first
    video stream."""
    av = _av()
    try:
        container = av.open(fp, format=CONTAINERS[kind][0], metadata_errors="ignore")
    except MemoryError:
        raise KestrelError(f"{desc}: too large to open (out of memory)") from None
    except Exception as e:  # FFmpeg's demuxer meets a broken header: any of its errors
        raise KestrelError(f"{desc}: not a readable video ({_reason(e)})") from None
    if not container.streams.video:
        container.close()
        raise KestrelError(f"{desc}: not a readable video (no video stream)")
    return container, container.streams.video[0]


def _header(container, stream, kind: str, desc: str) -> VideoHeader:
    cc = stream.codec_context
    width, height = int(cc.width or 0), int(cc.height or 0)
    if width < 1 or height < 1:
        raise KestrelError(f"{desc}: not a readable video (frames of {width}x{height} pixels)")
    if width * height > MAX_FRAME_PIXELS:
        raise KestrelError(
            f"{desc}: frames of {width}x{height} pixels are too large (more than "
            f"{MAX_FRAME_PIXELS} pixels)"
        )
    ratio = max(width, height) / min(width, height)
    if ratio > MAX_ASPECT_RATIO:
        raise KestrelError(
            f"{desc}: frames of {width}x{height} pixels have an aspect ratio of {ratio:.0f}, "
            f"over the video processor's limit of {MAX_ASPECT_RATIO}"
        )
    rate = stream.average_rate or stream.guessed_rate
    fps = float(Fraction(rate)) if rate else 0.0
    if not 0 < fps <= MAX_FPS or not math.isfinite(fps):
        raise KestrelError(f"{desc}: no usable frame rate ({fps:g} frames a second)")
    frames = int(stream.frames or 0)
    if frames > MAX_SOURCE_FRAMES:
        raise KestrelError(f"{desc}: {frames} frames, too many (more than {MAX_SOURCE_FRAMES})")
    if frames == 0:  # the container does not say (Matroska, WebM): its packets, not decoded
        try:
            for packet in container.demux(stream):
                if packet.size:
                    frames += 1
                    if frames > MAX_SOURCE_FRAMES:
                        raise KestrelError(
                            f"{desc}: more than {MAX_SOURCE_FRAMES} frames, too many"
                        )
        except KestrelError:
            raise
        except Exception as e:
            raise KestrelError(f"{desc}: not a readable video ({_reason(e)})") from None
    if frames < 1:
        raise KestrelError(f"{desc}: not a readable video (no frames)")
    return VideoHeader(kind, str(cc.name), width, height, frames, fps)


def probe_video(src) -> VideoHeader:
    """A video's header (container, codec, frame size, frames, frame rate) from a path,
    bytes or a data: URL, with no frame decoded; KestrelError (one line) for anything
    refused before decoding (see the module doc)."""
    fp, kind, desc = _source(src)
    container, stream = _open(fp, kind, desc)
    try:
        return _header(container, stream, kind, desc)
    finally:
        container.close()


def _frames(src, wanted: list[int], size: tuple[int, int] | None):
    """(header, the frames at the source indices `wanted`, in order: uint8 (n, h, w, 3),
    each resized to `size` (h, w) by resize_bicubic_aa when given). Frames are decoded in
    presentation order up to the last wanted one; the others are dropped as decoded."""
    fp, kind, desc = _source(src)
    container, stream = _open(fp, kind, desc)
    try:
        head = _header(container, stream, kind, desc)
    finally:
        container.close()
    if not isinstance(fp, str):
        fp.seek(0)  # the header (and a packet count) read part of the buffer
    container, stream = _open(fp, kind, desc)
    try:
        stream.codec_context.thread_type = "AUTO"  # FFmpeg's threads: the same frames, sooner
        h, w = size or (head.height, head.width)
        out = np.empty((len(wanted), h, w, 3), dtype=np.uint8)
        need: dict[int, list[int]] = {}
        for j, i in enumerate(wanted):
            need.setdefault(i, []).append(j)
        last, got, decoded, taps = max(wanted), 0, 0, {}
        for frame in container.decode(stream):
            i, decoded = decoded, decoded + 1
            if i > last:
                break
            if i not in need:
                continue
            if (frame.width, frame.height) != (head.width, head.height):
                raise KestrelError(
                    f"{desc}: frame {i} is {frame.width}x{frame.height} pixels, the stream "
                    f"says {head.width}x{head.height} (a size change is not supported)"
                )
            rgb = frame.to_ndarray(format="rgb24")
            if size is not None:
                rgb = resize_bicubic_aa(rgb, h, w, taps)
            for j in need[i]:
                out[j] = rgb
                got += 1
        if got < len(wanted):
            raise KestrelError(
                f"{desc}: not a readable video (the stream says {head.frames} frames, "
                f"{decoded} decoded)"
            )
        return head, out
    except KestrelError:
        raise
    except MemoryError:
        raise KestrelError(f"{desc}: too large to decode (out of memory)") from None
    except Exception as e:  # FFmpeg's decoders meet a broken stream: any of their errors
        raise KestrelError(f"{desc}: not a readable video ({_reason(e)})") from None
    finally:
        container.close()


def prepare_video(src, cfg: VideoConfig, plan: VideoPlan | None = None) -> VideoInput:
    """Probe, sample, decode, resize and patchify one video (see the module doc)."""
    if plan is None:
        plan = cfg.plan(probe_video(src))
    size = (plan.height, plan.width) if cfg.do_resize else None
    _, frames = _frames(src, plan.indices, size)
    return_freed_memory()  # FFmpeg's frame pool and the dropped frames
    return patchify(frames, cfg, plan)


def patchify(frames: np.ndarray, cfg: VideoConfig, plan: VideoPlan) -> VideoInput:
    """Resized uint8 frames (n, h, w, 3) -> VideoInput, one temporal patch at a time."""
    n, h, w, C = frames.shape
    ps, m, tp = cfg.patch_size, cfg.merge_size, cfg.temporal_patch_size
    t, gh, gw = plan.grid
    out = np.empty((t * gh * gw, C * tp * ps * ps), dtype=np.float32)
    view = out.reshape(t, gh // m, gw // m, m, m, C, tp, ps, ps)
    mean = np.array(cfg.image_mean, dtype=np.float32)
    std = np.array(cfg.image_std, dtype=np.float32)
    if cfg.do_rescale and cfg.do_normalize:  # fused, as the processor's torch code does
        inv = np.float32(1.0 / cfg.rescale_factor)
        mean, std = mean * inv, std * inv
    for g in range(t):
        idx = [min(g * tp + k, n - 1) for k in range(tp)]  # the last frame repeated
        f = frames[idx].astype(np.float32)
        if cfg.do_normalize:
            f -= mean
            f /= std
        elif cfg.do_rescale:
            f *= np.float32(cfg.rescale_factor)
        # (tp, h, w, C) -> (block row, block col, row in block, col in block, C, tp, y, x)
        p = f.reshape(tp, gh // m, m, ps, gw // m, m, ps, C).transpose(1, 4, 2, 5, 7, 0, 3, 6)
        view[g] = p
    digest = hashlib.sha1(out).hexdigest()[:16] + f"-v{t}x{gh}x{gw}"
    return VideoInput(out, (t, gh, gw), digest, m, list(plan.timestamps))
