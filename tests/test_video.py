"""Qwen3-VL with videos against transformers (fp32, CPU): tiny videos written here with
PyAV (MP4/MPEG-4, Matroska/FFV1, AVI/MJPEG), read for the reference by transformers' own
PyAV reader (every frame, then sampled by the processor), and compared with
Qwen3VLProcessor (its Qwen3VLVideoProcessor: sampling, resize, patches, timestamps) +
Qwen3VLForConditionalGeneration on the tiny random checkpoint of test_qwen3_vl.py: frame
patches, prompt ids, M-RoPE positions (get_rope_index), logits and greedy tokens; then
the limits (refused from the header, before a frame is decoded) and run / chat / serve."""

from __future__ import annotations

import base64
import json
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch
from test_qwen3_vl import (
    ATOL,
    MAX_PIXELS,
    MIN_PIXELS,
    greedy_text,
    hf_prompt_logits,
    make_vl_checkpoint,
    picture,
)

from kestrel_cli import Engine
from kestrel_cli.core.errors import KestrelError

VIDEO_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}"
    "{% if c['type'] == 'image' or 'image' in c or 'image_url' in c %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'video' or 'video' in c %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# t * h * w of the sampled frames: 4096..24576 pixels (4 frames of 96 x 64 fit, 8 do not)
V_MIN, V_MAX = 32 * 32 * 4, 32 * 32 * 4 * 6
VIDEO_CONFIG = dict(
    size={"shortest_edge": V_MIN, "longest_edge": V_MAX},
    patch_size=16,
    temporal_patch_size=2,
    merge_size=2,
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
    fps=2,
    min_frames=4,
    max_frames=8,
)
# name -> (container, codec, pixel format, frames, width, height, fps)
VIDEOS = {
    "a": ("mp4", "mpeg4", "yuv420p", 16, 96, 72, 8),  # 4 of 16 sampled, 72 -> 64 rows
    "b": ("mp4", "mpeg4", "yuv420p", 40, 80, 48, 4),  # 20 wanted, 8 kept; shrunk to 32 x 64
    "c": ("mp4", "mpeg4", "yuv420p", 3, 64, 64, 2),  # 3 frames: the last one repeated
    "d": ("mkv", "ffv1", "yuv444p", 12, 50, 40, 5),  # no frame count in the container
    "e": ("avi", "mjpeg", "yuvj420p", 10, 64, 48, 10),
    "f": ("mp4", "mpeg4", "yuv420p", 8, 24, 20, 4),  # under 32 pixels: scaled up first
}


def write_video(path: Path, frames: np.ndarray, fps, codec: str, pix_fmt: str) -> Path:
    with av.open(str(path), "w") as c:
        s = c.add_stream(codec, rate=Fraction(fps))
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], pix_fmt
        for f in frames:
            for pkt in s.encode(av.VideoFrame.from_ndarray(f, format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    return path


def moving_frames(n: int, w: int, h: int, seed: int) -> np.ndarray:
    """n frames of a smooth random picture sliding right, its colours drifting."""
    base = np.asarray(picture(w + 2 * n, h, seed)).astype(np.int16)
    return np.stack(
        [np.clip(base[:, 2 * k : 2 * k + w] + 3 * k, 0, 255).astype(np.uint8) for k in range(n)]
    )


def make_video(d: Path, name: str) -> Path:
    ext, codec, pix, n, w, h, fps = VIDEOS[name]
    return write_video(d / f"{name}.{ext}", moving_frames(n, w, h, ord(name)), fps, codec, pix)


def hf_processor(d: Path):
    import transformers as tf
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    ip = Qwen2VLImageProcessorPil(
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )
    tok = tf.AutoTokenizer.from_pretrained(d)

    class Processor(tf.Qwen3VLProcessor):  # with the stand-in video processor below
        def check_argument_for_proper_class(self, name, arg):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)

    return Processor(
        image_processor=ip,
        tokenizer=tok,
        video_processor=RefVideoProcessor(),
        chat_template=VIDEO_TEMPLATE,
    )


class RefVideoProcessor:
    """Stand-in for transformers' Qwen3VLVideoProcessor, which needs torchvision: no
    torchvision build for this torch (2.13.0+cpu) installs from PyPI (0.28.0's extension
    fails to load). It runs the processor's own torchvision-free code (sample_frames,
    smart_resize, patchify, from transformers) and, for its two torchvision calls, what
    they compute on uint8 CPU frames (torchvision 0.28's source): tvF.resize(BICUBIC,
    antialias) -> F.interpolate(uint8, "bicubic", antialias=True), the image returned as
    is at the same size; tvF.normalize with the fused mean / std -> (x - m) / s in
    float32. Given to transformers' Qwen3VLProcessor, which writes the prompt text."""

    patch_size, temporal_patch_size, merge_size = 16, 2, 2
    fps, min_frames, max_frames = VIDEO_CONFIG["fps"], 4, 8
    model_input_names = ["pixel_values_videos", "video_grid_thw"]

    def __call__(self, videos, video_metadata=None, **kwargs):
        from transformers.feature_extraction_utils import BatchFeature
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
            Qwen3VLVideoProcessor as P,
        )
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize

        pixels, grids = [], []
        for frames, md in zip(videos, video_metadata):
            idx = P.sample_frames(self, md)
            md.frames_indices = idx
            v = torch.from_numpy(np.ascontiguousarray(frames[idx])).permute(0, 3, 1, 2)
            v = v.contiguous()
            h, w = smart_resize(len(idx), v.shape[2], v.shape[3], 2, 32, V_MIN, V_MAX)
            if (h, w) != tuple(v.shape[2:]):
                v = torch.nn.functional.interpolate(
                    v, size=[h, w], mode="bicubic", align_corners=False, antialias=True
                )
            mean = torch.tensor([0.5] * 3) * (1.0 / (1 / 255))
            std = torch.tensor([0.5] * 3) * (1.0 / (1 / 255))
            v = v.to(torch.float32).sub_(mean.view(-1, 1, 1)).div_(std.view(-1, 1, 1))
            patches, t, gh, gw = P.patchify(self, v[None], 16, 2, 2)
            pixels.append(patches[0])
            grids.append([t, gh, gw])
        return BatchFeature(
            {
                "pixel_values_videos": torch.cat(pixels),
                "video_grid_thw": torch.tensor(grids),
                "video_metadata": list(video_metadata),
            }
        )


def hf_video(path: Path):
    """Every frame and the metadata as transformers' PyAV reader gives them (a container
    without a frame count: every frame decoded here, the same stream's rate)."""
    from transformers.video_utils import VideoMetadata, read_video_pyav

    with av.open(str(path)) as c:
        s = c.streams.video[0]
        n, fps = s.frames, float(s.average_rate)
        if n == 0:
            frames = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(s)])
            return frames, VideoMetadata(total_num_frames=len(frames), fps=fps)
    frames, md = read_video_pyav(
        str(path), sample_indices_fn=lambda metadata, **kw: np.arange(metadata.total_num_frames)
    )
    md.frames_indices = None
    return frames, md


def media_of(messages):
    images, videos = [], []
    for m in messages:
        if isinstance(m["content"], list):
            for c in m["content"]:
                if c["type"] == "image":
                    images.append(str(c["image"]))
                elif c["type"] == "video":
                    videos.append(Path(c["video"]))
    return images, videos


def hf_inputs(proc, messages):
    text = proc.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    images, videos = media_of(messages)
    frames, metas = zip(*map(hf_video, videos)) if videos else ((), ())
    inputs = proc(
        text=[text],
        images=images or None,
        videos=list(frames) or None,
        videos_kwargs={"video_metadata": list(metas)} if videos else {},
        return_tensors="pt",
    )
    inputs.pop("video_metadata", None)  # the processor's own, not a model input
    return inputs


@pytest.fixture(scope="module")
def vv(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3vl_video")
    model = make_vl_checkpoint(d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = VIDEO_TEMPLATE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "video_preprocessor_config.json").write_text(
        json.dumps({**VIDEO_CONFIG, "video_processor_type": "Qwen3VLVideoProcessor"})
    )
    eng = Engine.from_pretrained(d, threads=2)
    vids = {name: make_video(d, name) for name in VIDEOS}
    img = d / "i.png"
    picture(100, 70, 1).save(img)
    return d, model, eng, hf_processor(d), vids, img


def one_video(src, text="What happens?"):
    src = src if isinstance(src, (str, bytes)) else str(src)
    return [
        {
            "role": "user",
            "content": [{"type": "video", "video": src}, {"type": "text", "text": text}],
        }
    ]


# ------------------------------------------------------------------ preprocessing


@pytest.mark.parametrize("name", sorted(VIDEOS))
def test_frames_match_video_processor(vv, name):
    from kestrel_cli.models.video import VideoConfig, prepare_video, probe_video

    d, _, _, proc, vids, _ = vv
    cfg = VideoConfig.from_dir(d)
    head = probe_video(vids[name])
    frames, md = hf_video(vids[name])
    assert (head.frames, head.fps, head.width, head.height) == (
        md.total_num_frames,
        md.fps,
        frames.shape[2],
        frames.shape[1],
    )
    ours = prepare_video(str(vids[name]), cfg)
    ref = proc.video_processor(videos=[frames], video_metadata=[md])
    assert list(ours.grid) == ref["video_grid_thw"][0].tolist()
    assert ours.patches.shape == ref["pixel_values_videos"].shape
    np.testing.assert_array_equal(ours.patches, ref["pixel_values_videos"].numpy())
    expect = proc._calculate_timestamps(md.frames_indices, md.fps, 2)
    assert ours.timestamps == expect


@pytest.mark.parametrize(
    "src,dst",
    [
        ((72, 96), (64, 96)),  # one axis
        ((48, 80), (32, 64)),
        ((20, 24), (32, 32)),  # up
        ((37, 53), (96, 32)),  # up and down
        ((1080, 1920), (224, 416)),
        ((300, 40), (32, 320)),
    ],
)
def test_resize_is_torch_uint8_bicubic_antialias(src, dst):
    """torchvision's resize of uint8 frames is torch's uint8 bicubic antialias kernel."""
    from kestrel_cli.models.video import resize_bicubic_aa

    rng = np.random.default_rng(sum(src))
    img = rng.integers(0, 256, (*src, 3), dtype=np.uint8)
    img[: src[0] // 3] = 255  # saturated rows: the clamps
    img[-3:] = 0
    ours = resize_bicubic_aa(img, *dst)
    t = torch.from_numpy(img).permute(2, 0, 1)[None].contiguous()
    ref = torch.nn.functional.interpolate(t, size=dst, mode="bicubic", antialias=True)
    np.testing.assert_array_equal(ours, ref[0].permute(1, 2, 0).numpy())


def test_sampling_as_processor():
    from types import SimpleNamespace

    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from transformers.video_utils import VideoMetadata

    from kestrel_cli.models.video import VideoConfig

    vp = SimpleNamespace(fps=2, min_frames=4, max_frames=768)  # the class defaults
    cfg = VideoConfig()
    for frames, fps in [(1, 30), (3, 30), (100, 29.97), (7200, 24), (4000, 1.5), (90, 60)]:
        md = VideoMetadata(total_num_frames=frames, fps=fps)
        assert cfg.sample(frames, fps) == Qwen3VLVideoProcessor.sample_frames(vp, md).tolist()


def test_smart_resize_as_processor():
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as ref

    from kestrel_cli.models.video import smart_resize

    rng = np.random.default_rng(0)
    for _ in range(300):
        t = int(rng.integers(2, 800))
        h, w = (int(x) for x in rng.integers(8, 4000, 2))
        if max(h, w) / min(h, w) > 150:
            continue
        args = (t, h, w, 2, 32, 4096, 25165824)
        assert smart_resize(*args) == ref(*args), args


# ------------------------------------------------------------------ whole prompts


@pytest.mark.parametrize("which", ["a", "b", "c", "d", "e", "image+a", "a+c"])
def test_prompt_ids_positions_logits_match_transformers(vv, which):
    d, model, eng, proc, vids, img = vv
    if which == "image+a":
        msgs = [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": str(img)},
                    {"type": "text", "text": "and then "},
                    {"type": "video", "video": str(vids["a"])},
                    {"type": "text", "text": " what?"},
                ],
            }
        ]
    elif which == "a+c":
        msgs = [
            {"role": "system", "content": "You watch."},
            {
                "role": "user",
                "content": [
                    {"type": "video", "video": str(vids["a"])},
                    {"type": "text", "text": "Compare"},
                    {"type": "video", "video": str(vids["c"])},
                ],
            },
        ]
    else:
        msgs = one_video(vids[which])
    inputs = hf_inputs(proc, msgs)
    prompt = eng.encode_prompt(msgs)
    assert list(prompt) == inputs["input_ids"][0].tolist()
    ref_pos, ref_delta = model.model.get_rope_index(
        inputs["input_ids"],
        inputs["mm_token_type_ids"],
        inputs.get("image_grid_thw"),
        inputs["video_grid_thw"],
    )
    np.testing.assert_array_equal(prompt.positions, ref_pos[:, 0].numpy())
    assert prompt.rope_delta == int(ref_delta[0, 0])
    ref = hf_prompt_logits(model, inputs)
    ours = eng.prompt_logits(msgs)
    n_vid = int((inputs["input_ids"] == model.config.video_token_id).sum())
    n_img = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert eng.image_tokens == n_vid + n_img and n_vid > 0
    diff = float(np.abs(ours - ref).max())
    print(f"{which}: {ours.shape[0]} tokens, {n_vid} video tokens, max abs diff {diff:.2e}")
    assert ours.shape == ref.shape and diff < ATOL


def test_timestamps_in_the_prompt(vv):
    d, model, eng, proc, vids, img = vv
    text = eng.tokenizer.decode(eng.encode_prompt(one_video(vids["a"])))
    # 4 of 16 frames at 8 fps: 0, 5, 10, 15 -> pairs at 0.3125 s and 1.5625 s
    frame = "<|video_pad|>" * 6
    assert (
        f"<0.3 seconds><|vision_start|>{frame}<|vision_end|>"
        f"<1.6 seconds><|vision_start|>{frame}<|vision_end|>What happens?"
    ) in text


def test_greedy_tokens_identical(vv):
    d, model, eng, proc, vids, img = vv
    msgs = one_video(vids["b"], "Describe it.")
    inputs = hf_inputs(proc, msgs)
    with torch.no_grad():
        ref = model.generate(
            **inputs, max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, inputs["input_ids"].shape[1] :].tolist()
    eng.reset()
    ours = [
        c.token for c in eng.stream(msgs, max_tokens=10, ignore_eos=True) if c.token is not None
    ]
    assert ours == ref


def test_kv_cache_reuse_across_turns(vv):
    d, model, eng, proc, vids, img = vv
    turn1 = one_video(vids["a"], "Describe it.")
    eng.reset()
    reply = [
        c.token for c in eng.stream(turn1, max_tokens=4, ignore_eos=True) if c.token is not None
    ]
    turn2 = turn1 + [
        {"role": "assistant", "content": eng.tokenizer.decode(reply)},
        {"role": "user", "content": "And then?"},
    ]
    ids2 = eng.encode_prompt(turn2)
    logits, reused = eng.prefill(ids2)
    assert reused > len(eng.encode_prompt(turn1)) - 3  # the video came from the cache
    ref = hf_prompt_logits(model, hf_inputs(proc, turn2))
    assert float(np.abs(logits[-1] - ref[-1]).max()) < ATOL


def test_data_url_and_bytes_as_the_file(vv):
    d, model, eng, proc, vids, img = vv
    raw = vids["e"].read_bytes()
    url = "data:video/x-msvideo;base64," + base64.b64encode(raw).decode()
    want = eng.encode_prompt(one_video(vids["e"]))
    for src in (url, raw):
        got = eng.encode_prompt(one_video(src))
        assert list(got) == list(want) and got.keys == want.keys
        np.testing.assert_array_equal(got.images[0].patches, want.images[0].patches)


# ------------------------------------------------------------------ limits and errors


@pytest.fixture
def no_frames(monkeypatch):
    """Decoding frames raises (and is recorded): what is refused is refused before."""
    import kestrel_cli.models.video as video

    calls = []

    def refuse(*a, **k):
        calls.append(a)
        raise AssertionError("a frame was decoded")

    monkeypatch.setattr(video, "_frames", refuse)
    return calls


@pytest.mark.parametrize(
    "limit,value,needle",
    [
        ("MAX_SOURCE_FRAMES", 15, "16 frames, too many"),
        ("MAX_FRAME_PIXELS", 96 * 72 - 1, "96x72 pixels are too large"),
        ("MAX_VIDEO_BYTES", 100, "too large (more than 100 bytes)"),
    ],
)
def test_limits_refused_before_decoding(vv, monkeypatch, no_frames, limit, value, needle):
    import kestrel_cli.models.video as video

    d, model, eng, proc, vids, img = vv
    monkeypatch.setattr(video, limit, value)
    with pytest.raises(
        KestrelError, match="video .*" + needle.replace("(", r"\(").replace(")", r"\)")
    ):
        eng.encode_prompt(one_video(vids["a"]))
    assert no_frames == []


def test_uncounted_frames_limit(vv, monkeypatch, no_frames):
    """Matroska says no frame count: its packets are counted, and refused past the limit."""
    import kestrel_cli.models.video as video

    d, model, eng, proc, vids, img = vv
    monkeypatch.setattr(video, "MAX_SOURCE_FRAMES", 11)
    with pytest.raises(KestrelError, match="more than 11 frames"):
        eng.encode_prompt(one_video(vids["d"]))
    assert no_frames == []


def test_video_tokens_over_context_refused_before_decoding(vv, no_frames):
    d, model, eng, proc, vids, img = vv
    small = Engine.from_pretrained(d, threads=1, ctx_size=24)
    with pytest.raises(KestrelError, match="context size 24") as e:
        small.encode_prompt(one_video(vids["a"]))
    assert "12 for 1 video(s)" in str(e.value) and no_frames == []


def test_too_many_videos(vv, no_frames):
    from kestrel_cli.models.video import MAX_VIDEOS_PER_PROMPT

    d, model, eng, proc, vids, img = vv
    n = MAX_VIDEOS_PER_PROMPT + 1
    msgs = [{"role": "user", "content": [{"type": "video", "video": str(vids["c"])}] * n}]
    with pytest.raises(KestrelError, match=f"{n} videos in one prompt"):
        eng.encode_prompt(msgs)
    assert no_frames == []


def test_bad_videos_one_clear_error(vv, tmp_path):
    d, model, eng, proc, vids, img = vv
    garbage = tmp_path / "g.mp4"
    garbage.write_bytes(b"\x00\x00\x00\x18ftypmp42" + bytes(range(256)) * 8)
    text = tmp_path / "t.mp4"
    text.write_text("not a video at all")
    cut = tmp_path / "cut.mp4"
    cut.write_bytes(vids["a"].read_bytes()[:600])  # no moov atom
    one = tmp_path / "one.mp4"
    write_video(one, moving_frames(1, 64, 64, 1), 4, "mpeg4", "yuv420p")
    mkv_cut = tmp_path / "cut.mkv"
    mkv_cut.write_bytes(vids["d"].read_bytes()[:-2000])  # header whole, frames cut short
    cases = [
        (garbage, "not a readable video"),
        (text, r"not a readable video \(not an MP4, MOV, WebM, MKV or AVI file\)"),
        (cut, "not a readable video"),
        (one, "1 sampled, fewer than the 2 of a temporal patch"),
        (img, "not a readable video"),  # a PNG
        (tmp_path / "missing.mp4", "no such file"),
        ("https://example.com/cat.mp4", "not fetched"),
        ("data:video/mp4;base64,@@@", "not a readable video|not valid base64"),
        ("data:video/mp4,plain", "must be base64"),
    ]
    for src, needle in cases:
        with pytest.raises(KestrelError, match=needle) as e:
            eng.encode_prompt(one_video(src))
        msg = str(e.value)
        assert "\n" not in msg and "Traceback" not in msg and " at 0x" not in msg, msg
    # a Matroska whose frames end early: one line too (fewer frames than its packets say
    # is caught by the packet count itself, a broken last packet by the decoder)
    try:
        eng.encode_prompt(one_video(mkv_cut))
    except KestrelError as e:
        assert "\n" not in str(e)


def test_template_without_video_refused(vv, tmp_path):
    import shutil

    from test_qwen3_vl import VL_TEMPLATE

    d, model, eng, proc, vids, img = vv
    d2 = tmp_path / "m"
    shutil.copytree(d, d2)
    cfg = json.loads((d2 / "tokenizer_config.json").read_text())
    cfg["chat_template"] = VL_TEMPLATE  # images only
    (d2 / "tokenizer_config.json").write_text(json.dumps(cfg))
    e2 = Engine.from_pretrained(d2, threads=1)
    with pytest.raises(KestrelError, match="wrote 0 video token"):
        e2.encode_prompt(one_video(vids["a"]))


def test_text_only_model_refuses_videos(tmp_path, vv):
    from conftest import make_checkpoint

    d, model, eng, proc, vids, img = vv
    make_checkpoint(tmp_path, "qwen3")
    e = Engine.from_pretrained(tmp_path, threads=1)
    with pytest.raises(KestrelError, match="no vision tower"):
        e.encode_prompt(one_video(vids["a"]))


def test_video_config_checked(tmp_path):
    from kestrel_cli.models.video import VideoConfig

    for bad, needle in [
        ({"fps": 0}, "fps=0"),
        ({"min_frames": 9, "max_frames": 8}, "min_frames=9"),
        ({"patch_size": 0}, "patch_size=0"),
        ({"size": {"shortest_edge": 10, "longest_edge": 5}}, "min_pixels=10"),
        ({"image_std": [0.5, 0, 0.5]}, "image_std"),
        ({"num_frames": 8, "fps": 2}, "num_frames and fps"),
        ({"resample": 2}, "resample=2"),
    ]:
        (tmp_path / "video_preprocessor_config.json").write_text(json.dumps(bad))
        with pytest.raises(KestrelError, match=needle):
            VideoConfig.from_dir(tmp_path)
    (tmp_path / "video_preprocessor_config.json").unlink()
    cfg = VideoConfig.from_dir(tmp_path)  # the processor's defaults
    assert (cfg.fps, cfg.min_frames, cfg.max_frames) == (2, 4, 768)
    assert (cfg.min_pixels, cfg.max_pixels) == (128 * 32 * 32, 32 * 32 * 768)


# ------------------------------------------------------------------ kestrel run / chat / serve


def test_cli_run_with_a_video(vv):
    from typer.testing import CliRunner

    from kestrel_cli.cli import app
    from kestrel_cli.inference.timing import parse_lines

    d, model, eng, proc, vids, img = vv
    args = ["run", "-m", str(d), "--video", str(vids["a"]), "-p", "What happens?"]
    args += ["--vision-dtype", "f32"]  # the engine compared with is exact
    r = CliRunner().invoke(app, args + ["-n", "6", "--temp", "0", "--ignore-eos", "-t", "1"])
    assert r.exit_code == 0, r.output
    assert r.stdout.rstrip("\n") == greedy_text(eng, one_video(vids["a"]), 6)
    perf = parse_lines(r.stderr, "PERF")[-1]
    assert perf["image_tokens"] == 12 and perf["vision_ms"] > 0


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--video", "MISSING"], "no such file"),
        (["--video", "BAD"], "not a readable video"),
        (["--video", "A", "--raw"], "--video needs the chat template"),
    ],
)
def test_cli_run_video_errors_are_one_line(vv, tmp_path, extra, needle):
    from typer.testing import CliRunner

    from kestrel_cli.cli import app

    d, model, eng, proc, vids, img = vv
    bad = tmp_path / "bad.mp4"
    bad.write_bytes(b"\x00\x00\x00\x18ftypisom" + b"\x00" * 64)
    subst = {"MISSING": str(tmp_path / "none.mp4"), "BAD": str(bad), "A": str(vids["a"])}
    extra = [subst.get(x, x) for x in extra]
    r = CliRunner().invoke(app, ["run", "-m", str(d), "-p", "hi", "-n", "2", "-t", "1", *extra])
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.output


def test_chat_video_option_and_command(vv, tmp_path):
    import io

    from typer.testing import CliRunner

    from kestrel_cli.apps.chat import ChatSession, repl
    from kestrel_cli.cli import app

    d, model, eng, proc, vids, img = vv
    out = io.StringIO()
    s = ChatSession(eng, sampling=dict(max_tokens=3, temperature=0.0, ignore_eos=True), out=out)
    s.reset()
    lines = iter(
        [
            "/video " + str(tmp_path / "none.mp4"),
            "/video " + str(img),
            "/video " + str(vids["c"]),
            "What is it?",
            "And now?",
        ]
    )

    def read(_):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    repl(s, read=read)
    text = out.getvalue()
    assert "[error: video" in text and "no such file" in text and "not a readable video" in text
    assert "[video " in text and "attached to your next message" in text
    assert s.messages[0]["content"][0] == {"type": "video", "video": str(vids["c"])}
    assert s.messages[1]["content"] == greedy_text(eng, s.messages[:1], 3)
    assert s.messages[3]["content"] == greedy_text(eng, s.messages[:3], 3)
    # kestrel chat --video: the first message carries it; a bad one: one line, exit 1
    args = ["chat", "-m", str(d), "--temp", "0", "-n", "3", "-t", "1", "--ignore-eos"]
    args += ["--vision-dtype", "f32"]  # the engine compared with is exact
    r = CliRunner().invoke(app, args + ["--video", str(vids["c"])], input="What is it?\n")
    assert r.exit_code == 0, r.output
    assert greedy_text(eng, one_video(vids["c"], "What is it?"), 3) in r.stdout
    r = CliRunner().invoke(app, args + ["--video", str(img)], input="hi\n")
    assert r.exit_code == 1 and "not a readable video" in r.output and "Traceback" not in r.output


def test_server_video_url_parts(vv):
    import openai
    from starlette.testclient import TestClient

    from kestrel_cli.server import create_app

    d, model, eng, proc, vids, img = vv
    srv_eng = Engine.from_pretrained(d, threads=1, ctx_size=256)
    url = "data:video/mp4;base64," + base64.b64encode(vids["a"].read_bytes()).decode()
    with TestClient(create_app([srv_eng], queue_size=2)) as c:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="x", http_client=c, max_retries=0
        )
        r = client.chat.completions.create(
            model="m",
            temperature=0,
            max_tokens=5,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "video_url", "video_url": {"url": url}},
                        {"type": "text", "text": "What happens?"},
                    ],
                }
            ],
            extra_body={"ignore_eos": True},
        )
        msgs = one_video(vids["a"])
        assert r.choices[0].message.content == greedy_text(eng, msgs, 5)
        assert r.usage.prompt_tokens == len(eng.encode_prompt(msgs))

        def post(content):
            return c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": content}], "max_tokens": 2},
            )

        for u, param in [
            ("https://example.com/cat.mp4", "video_url.url"),
            ("data:video/mp4;base64,bm90IGEgdmlkZW8=", "messages"),
            ("data:video/mp4;base64,@@@", "messages"),
        ]:
            r = post(
                [{"type": "video_url", "video_url": {"url": u}}, {"type": "text", "text": "x"}]
            )
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert param in err["param"] and err["message"]
    small = Engine.from_pretrained(d, threads=1, ctx_size=12)
    with TestClient(create_app([small], queue_size=2)) as c2:
        r = c2.post(
            "/v1/chat/completions",
            json={
                "max_tokens": 2,
                "messages": [
                    {"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}
                ],
            },
        )
        assert r.status_code == 400 and "video(s) take 12 tokens" in r.json()["error"]["message"]
