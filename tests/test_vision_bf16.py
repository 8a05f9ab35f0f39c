"""The Qwen3-VL vision tower's bf16 mode (--vision-dtype): `auto` resolves by the CPU's
bf16 dot products (the feature check mocked), bf16 is refused where there are none, the
bf16 attention kernel and the whole bf16 tower stay within a bounded distance of the
exact float path (and far from what a wrong kernel would give), and [PERF] says which
dtype ran. The float path's parity with transformers is tests/test_qwen3_vl.py's."""

from __future__ import annotations

import numpy as np
import pytest
from test_qwen3_vl import make_vl_checkpoint, picture

from kestrel_cli import Engine
from kestrel_cli.core.errors import KestrelError
from kestrel_cli.inference.engine import LoadOptions
from kestrel_cli.models import qwen3_vl_vision as V
from kestrel_cli.runtime import kernels as K

needs_bf16 = pytest.mark.skipif(
    not K.HAVE_BF16_DOT, reason="this CPU has no AVX512-BF16: the bf16 kernels cannot run"
)


# ------------------------------------------------------------------ the dtype choice


@pytest.mark.parametrize("have", [True, False])
def test_auto_resolves_by_cpu_feature(monkeypatch, have):
    monkeypatch.setattr(K, "HAVE_BF16_DOT", have)
    assert V.resolve_dtype("auto") == ("bf16" if have else "f32")
    assert V.resolve_dtype("f32") == "f32"
    assert LoadOptions(vision_dtype="auto").resolved_vision_dtype() == V.resolve_dtype("auto")


def test_bf16_refused_without_the_instructions(monkeypatch):
    monkeypatch.setattr(K, "HAVE_BF16_DOT", False)
    with pytest.raises(KestrelError, match="needs a CPU with AVX512-BF16"):
        V.resolve_dtype("bf16")
    with pytest.raises(KestrelError, match="--vision-dtype bf16"):
        LoadOptions(vision_dtype="bf16").validate()
    with pytest.raises(KestrelError, match="--vision-dtype must be one of"):
        LoadOptions(vision_dtype="f16").validate()


def test_cli_bf16_without_the_instructions_is_one_line(monkeypatch):
    from typer.testing import CliRunner

    from kestrel_cli.cli import app

    monkeypatch.setattr(K, "HAVE_BF16_DOT", False)
    r = CliRunner().invoke(app, ["run", "--vision-dtype", "bf16", "-p", "hi", "-n", "1"])
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert r.exit_code == 1 and len(lines) == 1 and "AVX512-BF16" in lines[0]
    assert "Traceback" not in r.output


def test_cli_flag_listed():
    from typer.testing import CliRunner

    from kestrel_cli.cli import app

    for cmd in ("run", "chat", "serve"):
        r = CliRunner().invoke(app, [cmd, "--help"])
        assert r.exit_code == 0 and "--vision-dtype" in r.output


# ------------------------------------------------------------------ the attention kernel


def reference_attention(qkv, bias, cos, sin, nh, hd, scale):
    """float64 NumPy: q, k, v from qkv + bias, q and k rotated (rotate-half), softmax."""
    N, W = qkv.shape[0], nh * hd
    x = qkv.astype(np.float64) + bias
    q, k, v = (x[:, i * W : (i + 1) * W].reshape(N, nh, hd) for i in range(3))

    def rot(t):
        a, b = t[..., : hd // 2], t[..., hd // 2 :]
        c, s = cos[:, None, :], sin[:, None, :]
        return np.concatenate([a * c - b * s, b * c + a * s], -1)

    s = np.einsum("ihd,jhd->hij", rot(q), rot(k)) * scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hij,jhd->ihd", p, v).reshape(N, W)


@needs_bf16
@pytest.mark.parametrize("N,nh,hd", [(1, 2, 16), (70, 3, 72), (131, 2, 64), (40, 1, 128)])
def test_attention_bf16_close_to_float64(N, nh, hd):
    rng = np.random.default_rng(N)
    W = nh * hd
    qkv = rng.standard_normal((N, 3 * W)).astype(np.float32)
    bias = (0.3 * rng.standard_normal(3 * W)).astype(np.float32)
    ang = rng.uniform(0, 6, (N, hd // 2))
    cos, sin = np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)
    out = np.full((N, W), np.nan, np.float32)
    K.attention_bf16(qkv, bias, cos, sin, nh, hd, hd**-0.5, out, 2)
    want = reference_attention(qkv, bias, cos, sin, nh, hd, hd**-0.5)
    err = np.abs(out - want).max()
    assert err < 3e-2, err  # bf16 q, k, v, p: ~2^-8 relative per term
    # a kernel that skipped the bias or the rotation would fail the bound above
    assert np.abs(reference_attention(qkv, 0 * bias, cos, sin, nh, hd, hd**-0.5) - want).max() > 0.1
    if N > 1:
        unrotated = reference_attention(qkv, bias, 1 + 0 * cos, 0 * sin, nh, hd, hd**-0.5)
        assert np.abs(unrotated - want).max() > 0.1


@needs_bf16
def test_attention_bf16_rejects_bad_shapes():
    qkv = np.zeros((4, 3 * 32), np.float32)
    out = np.zeros((4, 32), np.float32)
    with pytest.raises(ValueError, match="head_dim"):
        K.attention_bf16(qkv, None, None, None, 2, 15, 1.0, np.zeros((4, 30), np.float32), 1)
    with pytest.raises(ValueError, match="cos, sin"):
        K.attention_bf16(qkv, None, np.zeros((4, 8), np.float32), None, 2, 16, 1.0, out, 1)
    with pytest.raises(ValueError, match="qkv"):
        K.attention_bf16(qkv[:, :90].copy(), None, None, None, 2, 16, 1.0, out, 1)


# ------------------------------------------------------------------ the tower


@pytest.fixture(scope="module")
def vlb(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3vl_bf16")
    make_vl_checkpoint(d)
    img = d / "a.png"
    picture(100, 70, 1).save(img)
    return d, img


def _patches(eng, img):
    from PIL import Image

    from kestrel_cli.models.images import ImageConfig, preprocess

    im = preprocess(Image.open(img), ImageConfig.from_dir(eng.path, eng.config.vision_config))
    return im.patches, [im.grid]


@needs_bf16
def test_bf16_tower_within_bound_of_f32(vlb):
    d, img = vlb
    eng = Engine.from_pretrained(d, threads=2)  # the library's default: exact
    tower = eng.model.vision
    assert tower.dtype == "f32" and not any(lin.bf16 for lin in tower.linears())
    patches, grids = _patches(eng, img)
    emb32, deep32 = tower.encode(patches, grids)
    assert tower.set_dtype("bf16") == "bf16"
    assert all(lin.bf16 for lin in tower.linears())
    emb16, deep16 = tower.encode(patches, grids)
    for a, b in [(emb16, emb32), *zip(deep16, deep32)]:
        rel = np.abs(a - b).max() / np.abs(b).max()
        assert 0 < rel < 1.5e-2, rel  # bf16 ran (not bit-exact) and stayed close (~5e-3)
    # garbage would be far: a row of another image position, for instance
    assert np.abs(emb16 - emb32[::-1]).max() / np.abs(emb32).max() > 0.3
    # back to f32: exact again (the float path is untouched by the bf16 one)
    tower.set_dtype("f32")
    np.testing.assert_array_equal(tower.encode(patches, grids)[0], emb32)


def test_weights_rounded_to_bf16():
    from kestrel_cli.formats.weights import Weight, quantize_q8_0

    rng = np.random.default_rng(0)
    w = rng.standard_normal((5, 7)).astype(np.float32)
    w[0, 0] = np.float32(1.0 + 2**-8)  # a tie: to even (1.0)
    w[0, 1] = np.float32(1.0 + 3 * 2**-8)  # a tie: to even (1.0 + 2^-6)
    b = V.to_bf16(Weight("f32", w, (5, 7)))
    assert b.fmt == "bf16" and b.shape == (5, 7)
    back = (b.data.astype(np.uint32) << 16).view(np.float32)
    assert back[0, 0] == 1.0 and back[0, 1] == np.float32(1.0 + 2**-6)
    assert np.abs(back - w).max() <= np.abs(w).max() * 2**-8
    assert V.to_bf16(b) is b
    # a block format (an mmproj GGUF's Q8_0): dequantised, then rounded
    q = Weight("q8_0", quantize_q8_0(rng.standard_normal((3, 64)).astype(np.float32)), (3, 64))
    qb = V.to_bf16(q)
    deq = q.dequantize()
    got = (qb.data.astype(np.uint32) << 16).view(np.float32)
    assert qb.fmt == "bf16" and np.abs(got - deq).max() <= np.abs(deq).max() * 2**-8


@needs_bf16
def test_engine_auto_and_perf_line(vlb):
    from typer.testing import CliRunner

    from kestrel_cli.cli import app
    from kestrel_cli.inference.timing import parse_lines

    d, img = vlb
    eng = Engine.from_pretrained(d, threads=1, vision_dtype="auto")
    assert eng.model.vision.dtype == "bf16" and eng.model.vision_bits == 16
    args = ["run", "-m", str(d), "--image", str(img), "-p", "Hi.", "-n", "2", "-t", "1"]
    for flag, bits in [([], 16), (["--vision-dtype", "f32"], 32), (["--vision-dtype", "bf16"], 16)]:
        r = CliRunner().invoke(app, args + flag)
        assert r.exit_code == 0, r.output
        perf = parse_lines(r.stderr, "PERF")[-1]
        assert perf["image_tokens"] == 6 and perf["vision_bits"] == bits


def test_perf_line_vision_keys():
    from kestrel_cli.inference.generate import Stats
    from kestrel_cli.inference.timing import format_perf, parse_line

    assert "vision_bits" not in format_perf(Stats(decode_tokens=1, decode_ms=1.0))
    for bits in (16, 32):
        tag, kv = parse_line(format_perf(Stats(image_tokens=4, vision_ms=2.0, vision_bits=bits)))
        assert tag == "PERF" and list(kv)[-3:] == ["vision_ms", "image_tokens", "vision_bits"]
        assert kv["vision_bits"] == bits and kv["image_tokens"] == 4


@needs_bf16
def test_heads_over_128_stay_float(vlb):
    import dataclasses

    d, img = vlb
    tower = Engine.from_pretrained(d, threads=1).model.vision
    tower.cfg = dataclasses.replace(tower.cfg, hidden_size=256, num_heads=1)  # head 256
    assert tower.set_dtype("auto") == "f32" and tower.dtype == "f32"
    with pytest.raises(KestrelError, match="head size 256"):
        tower.set_dtype("bf16")
