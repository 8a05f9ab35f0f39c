"""Qwen3-VL from llama.cpp's two GGUF files: the text model (arch qwen3vl) and the vision
tower's mmproj GGUF (`--mmproj`, or found beside the model), against the safetensors
checkpoint they were written from (models/mmproj.py, apps/mmproj_export.py).

The tiny random checkpoint's vision matrices are rounded to bfloat16 values, so the f32,
f16 and bf16 mmproj files hold exactly its weights and the logits must match tightly;
q8_0 rounds them again (a looser bound). Its preprocessor_config.json has the Qwen3-VL
processor's published pixel limits, the ones a GGUF model's images get."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from test_qwen3_vl import _data_url, greedy_text, make_vl_checkpoint, one_image, picture

from kestrel_cli import Engine
from kestrel_cli.core.errors import KestrelError

TYPES = ("f32", "f16", "bf16", "q8_0")
ATOL = 1e-4  # f32 / f16 / bf16 files: the same weights, the same arithmetic


def _checkpoint(d: Path):
    model = make_vl_checkpoint(d)
    with torch.no_grad():
        for name, p in model.model.visual.named_parameters():
            if p.ndim >= 2:  # what an f16 / bf16 mmproj stores at half width
                p.copy_(p.bfloat16().float())
    model.save_pretrained(d)
    pre = json.loads((d / "preprocessor_config.json").read_text())
    pre["size"] = {"shortest_edge": 65536, "longest_edge": 16777216}  # Qwen3-VL's published
    (d / "preprocessor_config.json").write_text(json.dumps(pre))
    return model


@pytest.fixture(scope="module")
def mm(tmp_path_factory):
    """(checkpoint dir, safetensors Engine, text GGUF, {type: mmproj}, images)."""
    from kestrel_cli.apps.gguf_export import quantize_checkpoint
    from kestrel_cli.apps.mmproj_export import write_mmproj

    root = tmp_path_factory.mktemp("mmproj")
    d = root / "ckpt"
    _checkpoint(d)
    g = root / "gguf"
    g.mkdir()
    text = g / "Qwen3-VL-tiny-F32.gguf"
    quantize_checkpoint(d, text, "f32", threads=2)
    files = {}
    for t in TYPES:
        files[t] = g / f"mmproj-Qwen3-VL-tiny-{t.upper()}.gguf"
        write_mmproj(d, files[t], t, threads=2)
    imgs = {"a": root / "a.png", "b": root / "b.jpg"}
    picture(100, 70, 1).save(imgs["a"])
    picture(60, 130, 2).save(imgs["b"], quality=95)
    ref = Engine.from_pretrained(d, threads=2)
    return d, ref, text, files, imgs


def two_images(a, b):
    return [
        {
            "role": "user",
            "content": [
                {"type": "image", "image": str(a)},
                {"type": "text", "text": "and"},
                {"type": "image", "image": str(b)},
                {"type": "text", "text": "Compare them."},
            ],
        }
    ]


@pytest.fixture(scope="module")
def engines(mm):
    d, ref, text, files, imgs = mm
    return {t: Engine.from_pretrained(text, mmproj=f, threads=2) for t, f in files.items()}


def test_mmproj_layout(mm):
    """What llama.cpp's converter writes (tools/mtmd/clip.cpp reads these)."""
    import gguf

    d, ref, text, files, imgs = mm
    types = {}
    for t, f in files.items():
        r = gguf.GGUFReader(str(f))
        assert r.fields["general.architecture"].contents() == "clip"
        assert r.fields["general.type"].contents() == "mmproj"
        assert r.fields["clip.projector_type"].contents() == "qwen3vl_merger"
        assert r.fields["clip.vision.projection_dim"].contents() == 64
        assert r.fields["clip.vision.image_size"].contents() == 6 * 16
        assert r.fields["clip.vision.is_deepstack_layers"].contents() == [True, False, True]
        types[t] = {x.name: x.tensor_type.name for x in r.tensors}
        shapes = {x.name: list(reversed(x.shape.tolist())) for x in r.tensors}
        assert shapes["v.patch_embd.weight"] == shapes["v.patch_embd.weight.1"] == [32, 3, 16, 16]
        assert shapes["v.blk.2.attn_qkv.weight"] == [96, 32]
        assert shapes["v.deepstack.2.fc2.weight"] == [64, 128]
        assert shapes["mm.0.weight"] == [128, 128] and shapes["v.post_ln.weight"] == [32]
        assert len(r.tensors) == 3 + 3 * 12 + 3 * 6 + 1  # patch x2 + bias, pos
    for t in TYPES:
        want = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[t]
        assert types[t]["v.blk.0.ffn_up.weight"] == types[t]["mm.2.weight"] == want
        assert types[t]["v.blk.0.ln1.weight"] == types[t]["v.blk.0.attn_qkv.bias"] == "F32"
        assert types[t]["v.position_embd.weight"] == "F32"
        assert types[t]["v.patch_embd.weight.1"] == ("F16" if t == "f16" else "F32")


@pytest.mark.parametrize("t", TYPES)
def test_logits_match_safetensors(mm, engines, t):
    d, ref, text, files, imgs = mm
    eng = engines[t]
    assert eng.config.model_type == "qwen3_vl" and eng.model.has_vision
    msgs = two_images(imgs["a"], imgs["b"])
    want = ref.prompt_logits(msgs)
    n_img = ref.image_tokens
    got = eng.prompt_logits(msgs)
    assert eng.image_tokens == n_img >= 2 * 64  # the processor's 65536-pixel minimum
    assert got.shape == want.shape
    diff = float(np.abs(got - want).max())
    scale = float(np.abs(want).max())
    print(f"{t}: {got.shape[0]} tokens, {n_img} image tokens, max abs diff {diff:.2e}")
    if t == "q8_0":
        # weights rounded to 8 bits: visibly off, still the same model
        assert 0 < diff < 0.02 * scale
        assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.9
    else:
        np.testing.assert_allclose(got, want, atol=ATOL, rtol=0)


def greedy_ids(eng, msgs, n):
    eng.reset()
    return [c.token for c in eng.stream(msgs, max_tokens=n, ignore_eos=True) if c.token is not None]


def test_greedy_reply_and_vision_tower_match(mm, engines):
    """The same tokens (their text may differ: the GGUF's vocabulary names the ids the
    tokenizer.json lacks [PADn], as llama.cpp's converter does)."""
    d, ref, text, files, imgs = mm
    eng = engines["f16"]
    msgs = one_image(imgs["b"])
    assert greedy_ids(eng, msgs, 6) == greedy_ids(ref, msgs, 6)
    prompt = ref.encode_prompt(msgs)
    im = prompt.images[0]
    a, da = ref.model.vision.encode(im.patches, [im.grid])
    b, db = eng.model.vision.encode(im.patches, [im.grid])
    np.testing.assert_allclose(b, a, atol=1e-5, rtol=0)
    for x, y in zip(db, da, strict=True):
        np.testing.assert_allclose(x, y, atol=1e-5, rtol=0)


def test_text_prompt_unchanged_by_the_tower(mm, engines):
    """A text-only prompt: the GGUF with its mmproj is the plain text model."""
    d, ref, text, files, imgs = mm
    plain = Engine.from_pretrained(text, threads=2)
    assert plain.config.model_type == "qwen3"
    ids = ref.tokenizer.encode("hello there, how are you", add_special_tokens=False)
    np.testing.assert_allclose(engines["f32"].logits(ids), plain.logits(ids), atol=1e-5, rtol=0)


# ------------------------------------------------------------------ found beside the model


def test_discovered_beside_the_model(mm, tmp_path):
    d, ref, text, files, imgs = mm
    shutil.copy(text, tmp_path / text.name)
    shutil.copy(files["bf16"], tmp_path / files["bf16"].name)
    eng = Engine.from_pretrained(tmp_path / text.name, threads=2)
    assert any(files["bf16"].name in n and "found beside" in n for n in eng.notices)
    msgs = one_image(imgs["a"])
    np.testing.assert_allclose(eng.prompt_logits(msgs), ref.prompt_logits(msgs), atol=ATOL)


def test_several_beside_the_model_none_guessed(mm):
    d, ref, text, files, imgs = mm
    eng = Engine.from_pretrained(text, threads=2)  # four mmproj files beside it
    assert eng.config.model_type == "qwen3"
    assert any("4 mmproj files" in n and "--mmproj" in n for n in eng.notices)
    ids = ref.tokenizer.encode("hi", add_special_tokens=False)
    assert eng.logits(ids).shape == (len(ids), 320)  # text still runs
    with pytest.raises(KestrelError, match=r"4 mmproj files .*mmproj-Qwen3-VL-tiny-BF16.*--mmproj"):
        eng.prompt_logits(one_image(imgs["a"]))


def test_none_beside_the_model(mm, tmp_path):
    d, ref, text, files, imgs = mm
    shutil.copy(text, tmp_path / "m.gguf")
    eng = Engine.from_pretrained(tmp_path / "m.gguf", threads=2)
    assert eng.notices == []
    with pytest.raises(KestrelError, match="Qwen3-VL's text model: images need .*--mmproj"):
        eng.prompt_logits(one_image(imgs["a"]))


def test_broken_file_found_beside_the_model(mm, tmp_path):
    d, ref, text, files, imgs = mm
    shutil.copy(text, tmp_path / "m.gguf")
    (tmp_path / "mmproj-x.gguf").write_bytes(files["f16"].read_bytes()[:5000])
    eng = Engine.from_pretrained(tmp_path / "m.gguf", threads=2)  # text still loads
    assert any("mmproj-x.gguf" in n for n in eng.notices)
    with pytest.raises(KestrelError, match="mmproj-x.gguf"):
        eng.prompt_logits(one_image(imgs["a"]))


# ------------------------------------------------------------------ refused


def _patched(src: Path, dst: Path, old: bytes, new: bytes) -> Path:
    data = src.read_bytes()
    assert data.count(old) == 1 and len(old) == len(new)
    dst.write_bytes(data.replace(old, new))
    return dst


def test_refusals(mm, tmp_path):
    from conftest import make_checkpoint
    from kestrel_cli.apps.gguf_export import quantize_checkpoint

    d, ref, text, files, imgs = mm
    f16 = files["f16"]

    def refused(match, model=text, mmproj=f16):
        with pytest.raises(KestrelError, match=match):
            Engine.from_pretrained(model, mmproj=mmproj, threads=1)

    refused("--mmproj .*: no such file", mmproj=tmp_path / "none.gguf")
    refused("not an mmproj file .*'qwen3vl'", mmproj=text)  # the text model as its tower
    refused("checkpoint directory: it has its vision tower .*already", model=d)
    other = _patched(f16, tmp_path / "q2.gguf", b"qwen3vl_merger", b"qwen2vl_merger")
    refused("projector type 'qwen2vl_merger' is not Qwen3-VL's", mmproj=other)
    # a tensor renamed: one the tower lacks, one it has no place for
    odd = _patched(f16, tmp_path / "odd.gguf", b"v.blk.1.ffn_up.weight", b"v.blk.1.ffn_xx.weight")
    refused("odd.gguf: .*(lacks|no place)", mmproj=odd)
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(f16.read_bytes()[:-100])
    refused("cut.gguf", mmproj=cut)
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf at all" * 10)
    refused("junk.gguf", mmproj=junk)
    # a text-only model
    q3 = tmp_path / "q3"
    make_checkpoint(q3, "qwen3")
    quantize_checkpoint(q3, tmp_path / "q3.gguf", "q8_0", threads=1)
    refused("arch qwen3, not Qwen3-VL's text model .*no vision tower", model=tmp_path / "q3.gguf")
    refused("checkpoint directory: --mmproj goes with a Qwen3-VL GGUF", model=q3)


def test_tower_of_another_model_refused(mm, tmp_path):
    """projection_dim is the text model's width: a tower for another size is refused."""
    import gguf

    d, ref, text, files, imgs = mm
    r = gguf.GGUFReader(str(files["f32"]))
    f = r.fields["clip.vision.projection_dim"]
    data = bytearray(files["f32"].read_bytes())
    off = f.offset + len(f.parts[0].tobytes()) + len(f.parts[1].tobytes()) + 4
    assert int.from_bytes(data[off : off + 4], "little") == 64
    data[off : off + 4] = (128).to_bytes(4, "little")
    bad = tmp_path / "wide.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(KestrelError, match="projects into 128 dims, .* hidden size is 64"):
        Engine.from_pretrained(text, mmproj=bad, threads=1)


# ------------------------------------------------------------------ kestrel run / quantize / serve


def _run(args):
    from typer.testing import CliRunner

    from kestrel_cli.cli import app

    return CliRunner().invoke(app, args)


def test_cli_run_with_mmproj_and_discovery(mm, engines, tmp_path):
    d, ref, text, files, imgs = mm
    msgs = one_image(imgs["a"], "Describe it.")
    assert greedy_ids(engines["f32"], msgs, 5) == greedy_ids(ref, msgs, 5)
    want = greedy_text(engines["f32"], msgs, 5)
    common = ["--image", str(imgs["a"]), "-p", "Describe it.", "-n", "5", "--temp", "0"]
    common += ["--ignore-eos", "-t", "1", "--vision-dtype", "f32"]  # exact, as engines[]
    r = _run(["run", "-m", str(text), "--mmproj", str(files["f32"]), *common])
    assert r.exit_code == 0, r.output
    assert r.stdout.rstrip("\n") == want
    shutil.copy(text, tmp_path / "model.gguf")
    shutil.copy(files["f32"], tmp_path / "mmproj-model-f32.gguf")
    r = _run(["run", "-m", str(tmp_path / "model.gguf"), *common])
    assert r.exit_code == 0, r.output
    assert "vision tower: mmproj-model-f32.gguf (found beside the model)" in r.stderr
    assert r.stdout.rstrip("\n") == want
    # errors: one line, exit status 1
    r = _run(["run", "-m", str(d), "--mmproj", str(files["f32"]), "-p", "hi", "-n", "1"])
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 1 and len(lines) == 1 and "already" in lines[0]
    assert "Traceback" not in r.output
    r = _run(["run", "-m", str(text), *common])  # four beside it
    assert r.exit_code == 1 and "choose the vision tower with --mmproj" in r.output


def test_cli_flags_listed():
    for cmd in ("run", "chat", "serve"):
        r = _run([cmd, "--help"])
        assert r.exit_code == 0 and "--mmproj" in r.output


def test_cli_quantize_writes_the_mmproj(mm, tmp_path):
    d, ref, text, files, imgs = mm
    out, proj = tmp_path / "m.gguf", tmp_path / "mmproj-m.gguf"
    r = _run(["quantize", str(d), str(out), "--type", "q8_0", "--mmproj", str(proj)])
    assert r.exit_code == 0, r.output
    assert proj.read_bytes() == files["f16"].read_bytes()  # --mmproj-type f16 by default
    eng = Engine.from_pretrained(out, threads=2)  # found beside it
    assert eng.model.has_vision and any("mmproj-m.gguf" in n for n in eng.notices)
    r = _run(["quantize", str(d), str(out), "--type", "q8_0", "--mmproj", str(out)])
    assert r.exit_code == 1 and "same file" in r.output
    q3 = tmp_path / "q3"
    from conftest import make_checkpoint

    make_checkpoint(q3, "qwen3")
    r = _run(
        [
            "quantize",
            str(q3),
            str(tmp_path / "q3.gguf"),
            "--type",
            "q8_0",
            "--mmproj",
            str(tmp_path / "p.gguf"),
        ]
    )
    assert r.exit_code == 1 and "no Qwen3-VL vision tower" in r.output
    assert not (tmp_path / "p.gguf").exists() and not (tmp_path / "q3.gguf").exists()


def test_server_with_mmproj(mm, engines):
    import openai
    from starlette.testclient import TestClient

    from kestrel_cli.server import create_app

    d, ref, text, files, imgs = mm
    eng = Engine.from_pretrained(text, mmproj=files["bf16"], threads=1, ctx_size=512)
    msgs = one_image(imgs["a"])
    with TestClient(create_app([eng], queue_size=2)) as c:
        client = openai.OpenAI(
            base_url="http://testserver/v1", api_key="x", http_client=c, max_retries=0
        )
        r = client.chat.completions.create(
            model="m",
            temperature=0,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": _data_url(imgs["a"])}},
                        {"type": "text", "text": "What is in this picture?"},
                    ],
                }
            ],
            extra_body={"ignore_eos": True},
        )
    assert r.choices[0].message.content == greedy_text(engines["bf16"], msgs, 4)
