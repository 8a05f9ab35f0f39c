"""Bad checkpoints give a KestrelError with one line naming the file or tensor."""
from __future__ import annotations

import json
import struct

import pytest

from kestrel_cli import Engine, KestrelError
from kestrel_cli.config import Config
from conftest import make_checkpoint


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    make_checkpoint(d, "qwen3")
    return d


def copy_dir(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def load_error(path) -> str:
    with pytest.raises(KestrelError) as e:
        Engine.from_pretrained(path, threads=1)
    msg = str(e.value)
    assert "\n" not in msg and msg
    return msg


def test_missing_dir(tmp_path):
    assert "does not exist" in load_error(tmp_path / "nope")


def test_no_config(tmp_path):
    assert "config.json" in load_error(tmp_path)


def test_unknown_model_type(good, tmp_path):
    d = copy_dir(good, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt_neox"
    (d / "config.json").write_text(json.dumps(cfg))
    msg = load_error(d)
    assert "gpt_neox" in msg and "qwen3_moe" in msg and "llama" in msg


def test_corrupt_config(good, tmp_path):
    d = copy_dir(good, tmp_path / "m")
    (d / "config.json").write_text("{not json")
    assert "config.json" in load_error(d)


def test_truncated_safetensors(good, tmp_path):
    d = copy_dir(good, tmp_path / "m")
    f = d / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    msg = load_error(d)
    assert "model.safetensors" in msg and "past the end" in msg


def test_header_past_end_of_file(good, tmp_path):
    d = copy_dir(good, tmp_path / "m")
    f = d / "model.safetensors"
    raw = f.read_bytes()
    f.write_bytes(struct.pack("<Q", len(raw) * 4) + raw[8:])
    msg = load_error(d)
    assert "model.safetensors" in msg and "header" in msg


def test_tiny_file(good, tmp_path):
    d = copy_dir(good, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"abc")
    assert "model.safetensors" in load_error(d)


def rewrite_header(path, edit):
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    edit(header)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n:])


def test_missing_tensor(good, tmp_path):
    d = copy_dir(good, tmp_path / "m")
    name = "model.layers.1.self_attn.k_norm.weight"
    rewrite_header(d / "model.safetensors", lambda h: h.pop(name))
    assert name in load_error(d)


def test_wrong_shape(good, tmp_path):
    d = copy_dir(good, tmp_path / "m")
    name = "model.layers.0.mlp.up_proj.weight"

    def edit(h):
        h[name]["shape"] = h[name]["shape"][::-1]
    rewrite_header(d / "model.safetensors", edit)
    msg = load_error(d)
    assert name in msg and "shape" in msg


def test_missing_tokenizer(good, tmp_path):
    d = copy_dir(good, tmp_path / "m")
    (d / "tokenizer.json").unlink()
    assert "tokenizer.json" in load_error(d)


def test_corrupt_gguf(tmp_path):
    f = tmp_path / "broken.gguf"
    f.write_bytes(b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 10)
    assert "broken.gguf" in load_error(f)


def test_config_rope_styles():
    base = dict(model_type="llama", hidden_size=64, num_hidden_layers=1, num_attention_heads=4)
    hub = Config.from_hf({**base, "rope_theta": 5e5})
    v5 = Config.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}})
    assert (hub.rope_inv_freq()[0] == v5.rope_inv_freq()[0]).all()
    assert hub.head_dim == 16
    q3 = Config.from_hf({**base, "model_type": "qwen3", "head_dim": 32})
    assert q3.head_dim == 32 and q3.num_key_value_heads == 4
    with pytest.raises(KestrelError, match="rope_type"):
        Config.from_hf({**base, "rope_scaling": {"rope_type": "su"}}).rope_inv_freq()
