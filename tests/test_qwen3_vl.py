"""Qwen3-VL with images against transformers (fp32, CPU) on a tiny random checkpoint with a
vision tower (deepstack on): preprocessing, the vision tower, M-RoPE positions, logits of
whole prompts with one and two images, greedy tokens, and the KV cache across turns."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import CORPUS
from kestrel_cli import Engine
from kestrel_cli.core.errors import KestrelError

VOCAB = 320
SPECIALS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]
VL_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
    "{% for c in message['content'] %}"
    "{% if c['type'] == 'image' or 'image' in c or 'image_url' in c %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif c['type'] == 'text' %}{{ c['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
MIN_PIXELS, MAX_PIXELS = 32 * 32 * 4, 32 * 32 * 12  # 4..12 image tokens an image
ATOL = 1e-4


def write_vl_tokenizer(d: Path) -> dict:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 10,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": VL_TEMPLATE,
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return {s: tok.token_to_id(s) for s in SPECIALS}


def make_vl_checkpoint(d: Path, seed: int = 0):
    import transformers as tf

    d.mkdir(parents=True, exist_ok=True)
    ids = write_vl_tokenizer(d)
    torch.manual_seed(seed)
    text = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        head_dim=32,
        rope_scaling={
            "rope_type": "default",
            "mrope_section": [8, 4, 4],
            "mrope_interleaved": True,
        },
    )
    vision = dict(
        depth=3,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        deepstack_visual_indexes=[0, 2],
        num_position_embeddings=36,
        patch_size=16,
        temporal_patch_size=2,
        spatial_merge_size=2,
    )
    cfg = tf.Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        tie_word_embeddings=False,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    model = tf.Qwen3VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if (
                name.endswith("norm.weight")
                or name.endswith("norm1.weight")
                or name.endswith("norm2.weight")
            ):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            elif "pos_embed" in name:
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    model.save_pretrained(d)
    (d / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "size": {"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
                "patch_size": 16,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen3VLProcessor",
            }
        )
    )
    return model


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

    class Processor(tf.Qwen3VLProcessor):  # images only: no video processor here
        def check_argument_for_proper_class(self, name, arg):
            if name != "video_processor":
                return super().check_argument_for_proper_class(name, arg)

    return Processor(
        image_processor=ip, tokenizer=tok, video_processor=None, chat_template=VL_TEMPLATE
    )


def hf_inputs(proc, messages):
    return proc.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )


def hf_prompt_logits(model, inputs) -> np.ndarray:
    with torch.no_grad():
        return model(**inputs).logits[0].float().numpy()


def picture(w: int, h: int, seed: int, mode: str = "RGB") -> Image.Image:
    """A smooth random picture (bicubic resampling has something to do)."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w]
    chans = [
        np.sin(xx / rng.uniform(3, 9) + rng.uniform(0, 6)) * np.cos(yy / rng.uniform(3, 9)) * 110
        + 128
        + rng.normal(0, 12, (h, w))
        for _ in range(len(mode))
    ]
    a = np.clip(np.stack(chans, -1), 0, 255).astype(np.uint8)
    return Image.fromarray(a[..., 0] if mode == "L" else a, mode)


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3vl")
    model = make_vl_checkpoint(d)
    eng = Engine.from_pretrained(d, threads=2)
    imgs = {"a": d / "a.png", "b": d / "b.jpg"}
    picture(100, 70, 1).save(imgs["a"])  # -> 96x64: 6x4 patches, 6 tokens
    picture(60, 130, 2).save(imgs["b"], quality=95)  # -> 64x128 (min 4 tokens): 8 tokens
    return d, model, eng, hf_processor(d), imgs


def one_image(path, text="What is in this picture?"):
    return [
        {
            "role": "user",
            "content": [{"type": "image", "image": str(path)}, {"type": "text", "text": text}],
        }
    ]


def two_images(a, b):
    return [
        {"role": "system", "content": "You look closely."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Compare "},
                {"type": "image", "image": str(a)},
                {"type": "text", "text": " with "},
                {"type": "image", "image": str(b)},
                {"type": "text", "text": " please."},
            ],
        },
    ]


# ------------------------------------------------------------------ preprocessing


@pytest.mark.parametrize(
    "size,mode",
    [
        ((100, 70), "RGB"),
        ((60, 130), "RGB"),
        ((333, 517), "RGB"),
        ((45, 40), "L"),
        ((90, 64), "RGBA"),
    ],
)
def test_preprocess_matches_processor(vl, tmp_path, size, mode):
    from kestrel_cli.models.images import ImageConfig, load_image, preprocess

    d, _, _, proc, _ = vl
    f = tmp_path / "x.png"
    picture(*size, seed=sum(size), mode=mode).save(f)
    ours = preprocess(load_image(str(f)), ImageConfig.from_dir(d))
    ref = proc.image_processor(images=[str(f)], return_tensors="np")
    assert list(ours.grid) == ref["image_grid_thw"][0].tolist()
    assert ours.patches.shape == ref["pixel_values"].shape
    np.testing.assert_array_equal(ours.patches, ref["pixel_values"])


def test_preprocess_pil_alpha_composited_like_processor(vl):
    from kestrel_cli.models.images import ImageConfig, load_image, preprocess

    d, _, _, proc, _ = vl
    img = picture(70, 50, 7, "RGBA")
    ours = preprocess(load_image(img), ImageConfig.from_dir(d))
    ref = proc.image_processor(images=[img], return_tensors="np")
    np.testing.assert_array_equal(ours.patches, ref["pixel_values"])


def test_exif_orientation_applied(tmp_path):
    from kestrel_cli.models.images import load_image

    img = picture(40, 20, 3)
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees on display
    f = tmp_path / "r.jpg"
    img.save(f, exif=exif)
    assert load_image(str(f)).size == (20, 40)


# ------------------------------------------------------------------ vision tower, positions


def test_vision_tower_matches_transformers(vl):
    d, model, eng, proc, imgs = vl
    inputs = hf_inputs(proc, two_images(imgs["a"], imgs["b"]))
    with torch.no_grad():
        out = model.model.visual(inputs["pixel_values"], grid_thw=inputs["image_grid_thw"])
    grids = [tuple(g) for g in inputs["image_grid_thw"].tolist()]
    emb, deep = eng.model.vision.encode(inputs["pixel_values"].numpy(), grids)
    np.testing.assert_allclose(emb, out.pooler_output.numpy(), atol=1e-5, rtol=0)
    assert len(deep) == 2
    for ours, ref in zip(deep, out.deepstack_features):
        np.testing.assert_allclose(ours, ref.numpy(), atol=1e-5, rtol=0)


def test_rope_index_matches_transformers(vl):
    d, model, eng, proc, imgs = vl
    msgs = two_images(imgs["a"], imgs["b"])
    inputs = hf_inputs(proc, msgs)
    ref_pos, ref_delta = model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], inputs["image_grid_thw"]
    )
    prompt = eng.encode_prompt(msgs)
    assert list(prompt) == inputs["input_ids"][0].tolist()
    np.testing.assert_array_equal(prompt.positions, ref_pos[:, 0].numpy())
    assert prompt.rope_delta == int(ref_delta[0, 0]) != 0


# ------------------------------------------------------------------ whole prompts


@pytest.mark.parametrize("which", ["a", "b", "ab", "pil"])
def test_prompt_logits_match_transformers(vl, which):
    d, model, eng, proc, imgs = vl
    if which == "pil":  # a PIL image in the content part, with alpha
        msgs = [
            {
                "role": "user",
                "content": [
                    {"type": "image", "image": picture(80, 90, 5, "RGBA")},
                    {"type": "text", "text": "What is it?"},
                ],
            }
        ]
    else:
        msgs = one_image(imgs[which]) if len(which) == 1 else two_images(imgs["a"], imgs["b"])
    inputs = hf_inputs(proc, msgs)
    ref = hf_prompt_logits(model, inputs)
    ours = eng.prompt_logits(msgs)
    n_img = int((inputs["input_ids"] == model.config.image_token_id).sum())
    assert eng.image_tokens == n_img > 0
    assert ours.shape == ref.shape and ours.dtype == np.float32
    diff = float(np.abs(ours - ref).max())
    print(f"{which}: {ours.shape[0]} tokens, {n_img} image tokens, max abs diff {diff:.2e}")
    assert diff < ATOL


def test_greedy_tokens_identical(vl):
    d, model, eng, proc, imgs = vl
    msgs = two_images(imgs["b"], imgs["a"])
    inputs = hf_inputs(proc, msgs)
    with torch.no_grad():
        ref = model.generate(
            **inputs, max_new_tokens=12, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, inputs["input_ids"].shape[1] :].tolist()
    eng.reset()
    ours = [
        c.token for c in eng.stream(msgs, max_tokens=12, ignore_eos=True) if c.token is not None
    ]
    assert ours == ref


def test_kv_cache_reuse_across_turns(vl):
    """A second turn reuses the first's cache (image included) and its logits equal a fresh
    prefill of the whole conversation: the positions after the image stay right."""
    d, model, eng, proc, imgs = vl
    turn1 = one_image(imgs["a"], "Describe it.")
    eng.reset()
    reply = [
        c.token for c in eng.stream(turn1, max_tokens=5, ignore_eos=True) if c.token is not None
    ]
    answer = eng.tokenizer.decode(reply)
    turn2 = turn1 + [
        {"role": "assistant", "content": answer},
        {"role": "user", "content": [{"type": "text", "text": "And then?"}]},
    ]
    ids2 = eng.encode_prompt(turn2)
    logits, reused = eng.prefill(ids2)
    assert reused > eng.encode_prompt(turn1).index(model.config.image_token_id) + 6
    fresh = eng.prompt_logits(turn2)
    np.testing.assert_allclose(logits[-1], fresh[-1], atol=1e-5, rtol=0)
    ref = hf_prompt_logits(model, hf_inputs(proc, turn2))
    assert float(np.abs(fresh - ref).max()) < ATOL


def test_same_size_images_do_not_share_cache(vl, tmp_path):
    d, model, eng, proc, imgs = vl
    other = tmp_path / "a2.png"
    picture(100, 70, 99).save(other)
    eng.reset()
    eng.prefill(eng.encode_prompt(one_image(imgs["a"])))
    logits, reused = eng.prefill(eng.encode_prompt(one_image(other)))
    start = eng.encode_prompt(one_image(other)).index(model.config.image_token_id)
    assert reused == start
    ref = hf_prompt_logits(model, hf_inputs(proc, one_image(other)))
    assert float(np.abs(logits[-1] - ref[-1]).max()) < ATOL


# ------------------------------------------------------------------ errors


def test_text_only_model_refuses_images(tmp_path):
    from conftest import make_checkpoint

    make_checkpoint(tmp_path, "qwen3")
    eng = Engine.from_pretrained(tmp_path, threads=1)
    f = tmp_path / "x.png"
    picture(40, 40, 0).save(f)
    with pytest.raises(KestrelError, match="no vision tower"):
        eng.prompt_logits(one_image(f))


def test_text_only_template_refuses_images_before_rendering(smollm2_engine, tmp_path):
    """The bundled SmolLM2's template cannot render image parts: the missing vision tower
    is the error, not the template's (was: 'chat template error: can only concatenate')."""
    f = tmp_path / "x.png"
    picture(40, 40, 0).save(f)
    with pytest.raises(KestrelError, match="no vision tower"):
        smollm2_engine.encode_prompt(one_image(f))


def test_bad_images_one_clear_error(vl, tmp_path):
    d, model, eng, proc, imgs = vl
    bad = tmp_path / "bad.png"
    bad.write_bytes(b"not a png at all")
    with pytest.raises(KestrelError, match="not a readable image"):
        eng.prompt_logits(one_image(bad))
    with pytest.raises(KestrelError, match="no such file"):
        eng.prompt_logits(one_image(tmp_path / "missing.png"))
    with pytest.raises(KestrelError, match="not fetched"):
        eng.prompt_logits(one_image("https://example.com/cat.jpg"))


def test_huge_image_refused_before_decoding(vl, tmp_path, monkeypatch):
    import kestrel_cli.models.images as images

    d, model, eng, proc, imgs = vl
    eng.image_config()  # read before the cap drops under its max_pixels
    monkeypatch.setattr(images, "MAX_DECODE_PIXELS", 100 * 69)
    with pytest.raises(KestrelError, match="too large"):
        eng.prompt_logits(one_image(imgs["a"]))  # 100 x 70 pixels


def test_forks_share_the_vision_tower(vl):
    d, model, eng, proc, imgs = vl
    fork = eng.fork()
    assert fork.model.vision is eng.model.vision


def test_too_many_image_tokens_for_context(vl):
    d, model, eng, proc, imgs = vl
    small = Engine.from_pretrained(d, threads=1, ctx_size=24)
    with pytest.raises(KestrelError, match="image"):
        small.prompt_logits(two_images(imgs["a"], imgs["b"]))


def test_image_tokens_over_context_refused_before_decoding(vl, no_decoding):
    """Text + image tokens past the context: refused from the headers (was: every image
    decoded and preprocessed first, then the length checked in prefill)."""
    d, model, eng, proc, imgs = vl
    small = Engine.from_pretrained(d, threads=1, ctx_size=24)
    calls = no_decoding
    with pytest.raises(KestrelError, match="context size 24") as e:
        small.encode_prompt(two_images(imgs["a"], imgs["b"]))
    assert "2 image(s)" in str(e.value) and calls == []


def test_too_many_images_refused_before_decoding(vl, no_decoding):
    from kestrel_cli.models.images import MAX_IMAGES_PER_PROMPT

    d, model, eng, proc, imgs = vl
    calls = no_decoding
    n = MAX_IMAGES_PER_PROMPT + 1
    msgs = [{"role": "user", "content": [{"type": "image", "image": str(imgs["a"])}] * n}]
    with pytest.raises(KestrelError, match=f"{n} images.*{MAX_IMAGES_PER_PROMPT}"):
        eng.encode_prompt(msgs)
    assert calls == []


def test_every_image_checked_before_any_is_decoded(vl, tmp_path, no_decoding):
    """A good image then a bad one: the bad one's header refuses the prompt before the good
    one is decoded; eight copies of the issue's 10 KB 9000x9000 PNG decode nothing."""
    from test_images import data_url, png_bomb

    d, model, eng, proc, imgs = vl
    thin = tmp_path / "thin.png"
    Image.new("L", (1, 300)).save(thin)  # aspect ratio 300
    calls = no_decoding
    with pytest.raises(KestrelError, match="aspect ratio"):
        eng.encode_prompt(two_images(imgs["a"], thin))
    bomb = data_url(png_bomb(9000, 9000))
    with pytest.raises(KestrelError, match="too large"):
        eng.encode_prompt(
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": bomb}}] * 8}]
        )
    assert calls == []


# ------------------------------------------------------------------ kestrel run / chat / serve


def greedy_text(eng, msgs, n):
    eng.reset()
    return "".join(c.text for c in eng.stream(msgs, max_tokens=n, ignore_eos=True))


def test_cli_run_with_images(vl):
    from typer.testing import CliRunner

    from kestrel_cli.cli import app
    from kestrel_cli.inference.timing import parse_lines

    d, model, eng, proc, imgs = vl
    r = CliRunner().invoke(
        app,
        [
            "run",
            "-m",
            str(d),
            "--image",
            str(imgs["a"]),
            "--image",
            str(imgs["b"]),
            "-p",
            "Compare them.",
            "-n",
            "6",
            "--temp",
            "0",
            "--ignore-eos",
            "-t",
            "1",
            "--vision-dtype",
            "f32",  # the engine compared with is exact (the library's default)
        ],
    )
    assert r.exit_code == 0, r.output
    msgs = [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": str(imgs["a"])},
                {"type": "image", "image": str(imgs["b"])},
                {"type": "text", "text": "Compare them."},
            ],
        }
    ]
    assert r.stdout.rstrip("\n") == greedy_text(eng, msgs, 6)
    perf = parse_lines(r.stderr, "PERF")[-1]
    assert perf["image_tokens"] == 14 and perf["vision_ms"] > 0


@pytest.mark.parametrize(
    "extra,needle",
    [
        (["--image", "MISSING"], "no such file"),
        (["--image", "BAD"], "not a readable image"),
        (["--image", "A", "--raw"], "--image needs the chat template"),
    ],
)
def test_cli_run_image_errors_are_one_line(vl, tmp_path, extra, needle):
    from typer.testing import CliRunner

    from kestrel_cli.cli import app

    d, model, eng, proc, imgs = vl
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff garbage")
    extra = [
        {"MISSING": str(tmp_path / "none.png"), "BAD": str(bad), "A": str(imgs["a"])}.get(x, x)
        for x in extra
    ]
    r = CliRunner().invoke(app, ["run", "-m", str(d), "-p", "hi", "-n", "2", "-t", "1", *extra])
    assert r.exit_code == 1, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1 and needle in lines[0] and "Traceback" not in r.output


def test_cli_run_image_on_text_model(tmp_path):
    from typer.testing import CliRunner

    from conftest import make_checkpoint
    from kestrel_cli.cli import app

    make_checkpoint(tmp_path, "qwen3")
    f = tmp_path / "x.png"
    picture(40, 40, 0).save(f)
    r = CliRunner().invoke(
        app, ["run", "-m", str(tmp_path), "--image", str(f), "-p", "hi", "-n", "2", "-t", "1"]
    )
    assert r.exit_code == 1 and "error:" in r.output and "no vision tower" in r.output


def test_chat_image_command_and_cache_across_turns(vl, tmp_path):
    import io

    from kestrel_cli.apps.chat import ChatSession, repl

    d, model, eng, proc, imgs = vl
    out = io.StringIO()
    s = ChatSession(eng, sampling=dict(max_tokens=4, temperature=0.0, ignore_eos=True), out=out)
    s.reset()
    lines = iter(
        [
            "/image " + str(tmp_path / "none.png"),
            "/image " + str(imgs["a"]),
            "What is it?",
            "And the colours?",
        ]
    )

    def read(_):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None

    repl(s, read=read)
    text = out.getvalue()
    assert "[error: image" in text and "attached to your next message" in text
    assert s.turn == 2 and isinstance(s.messages[0]["content"], list)
    assert s.messages[0]["content"][0] == {"type": "image", "image": str(imgs["a"])}
    assert (
        s.last_stats.cached_tokens
        > s.engine.encode_prompt(s.messages[:1]).index(model.config.image_token_id) + 6
    )  # the image came from the cache
    # the second turn's answer is the greedy continuation of the whole conversation
    first_reply = s.messages[1]["content"]
    assert first_reply == greedy_text(eng, s.messages[:1], 4)
    assert s.messages[3]["content"] == greedy_text(eng, s.messages[:3], 4)


def _data_url(path: Path) -> str:
    import base64

    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def test_server_image_url_parts(vl, tmp_path):
    import openai
    from starlette.testclient import TestClient

    from kestrel_cli.server import create_app

    d, model, eng, proc, imgs = vl
    srv_eng = Engine.from_pretrained(d, threads=1, ctx_size=256)
    png = tmp_path / "a.png"
    Image.open(imgs["a"]).save(png)
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
                        {"type": "image_url", "image_url": {"url": _data_url(png)}},
                        {"type": "text", "text": "What is in this picture?"},
                    ],
                }
            ],
            extra_body={"ignore_eos": True},
        )
        msgs = one_image(png)
        assert r.choices[0].message.content == greedy_text(eng, msgs, 5)
        assert r.usage.prompt_tokens == len(eng.encode_prompt(msgs))

        def post(content):
            return c.post(
                "/v1/chat/completions",
                json={"messages": [{"role": "user", "content": content}], "max_tokens": 2},
            )

        for url, param in [
            ("https://example.com/cat.png", "image_url.url"),
            ("data:image/png;base64,bm90IGFuIGltYWdl", "messages"),
            ("data:image/png;base64,@@@", "messages"),
        ]:
            r = post(
                [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "hi"}]
            )
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert param in err["param"] and err["message"]
        # too many image tokens for the context: 400, context_length_exceeded
        small = Engine.from_pretrained(d, threads=1, ctx_size=20)
        with TestClient(create_app([small], queue_size=2)) as c2:
            r = c2.post(
                "/v1/chat/completions",
                json={
                    "max_tokens": 2,
                    "messages": [
                        {
                            "role": "user",
                            "content": [
                                {"type": "image_url", "image_url": {"url": _data_url(png)}},
                                {"type": "image_url", "image_url": {"url": _data_url(png)}},
                                {"type": "text", "text": "hi"},
                            ],
                        }
                    ],
                },
            )
            assert r.status_code == 400 and "context" in r.json()["error"]["message"]
