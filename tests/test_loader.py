"""Bad checkpoints give a KestrelError with one line naming the file or tensor."""

from __future__ import annotations

import json
import struct

import pytest

from conftest import make_checkpoint
from kestrel_cli import Engine, KestrelError
from kestrel_cli.formats.config import Config


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
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    path.write_bytes(struct.pack("<Q", len(h)) + h + raw[8 + n :])


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


# ---------------------------------------------------------------- shard names (a hostile index)


def _sharded(good, d):
    """`good` as a one-shard checkpoint with an index naming the shard."""
    copy_dir(good, d)
    names = json.loads(
        (d / "model.safetensors").read_bytes()[
            8 : 8 + struct.unpack("<Q", (d / "model.safetensors").read_bytes()[:8])[0]
        ]
    )
    index = {
        "metadata": {},
        "weight_map": {k: "model.safetensors" for k in names if k != "__metadata__"},
    }
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d


def _point_index_at(d, shard):
    index = json.loads((d / "model.safetensors.index.json").read_text())
    first = next(iter(index["weight_map"]))
    index["weight_map"][first] = shard
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize(
    "shard",
    [
        "../outside.safetensors",
        "../../x.safetensors",
        "/etc/passwd",
        "sub/model.safetensors",
        "..",
        "",
        7,
        "a\\b.safetensors",
    ],
)
def test_index_shard_must_be_a_plain_name(good, tmp_path, shard):
    d = _sharded(good, tmp_path / "m")
    (tmp_path / "outside.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    (d / "sub").mkdir()
    (d / "sub" / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    _point_index_at(d, shard)
    msg = load_error(d)
    assert "model.safetensors.index.json" in msg and repr(shard) in msg and "plain file name" in msg


def test_index_shard_symlink_out_of_the_directory(good, tmp_path):
    d = _sharded(good, tmp_path / "m")
    (tmp_path / "outside.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    (d / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    _point_index_at(d, "link.safetensors")
    msg = load_error(d)
    assert (
        "model.safetensors.index.json" in msg and "'link.safetensors'" in msg and "outside" in msg
    )
    # without an index, a listed *.safetensors link that leaves the directory is refused too
    (d / "model.safetensors.index.json").unlink()
    assert "'link.safetensors'" in load_error(d)


def test_hf_cache_snapshot_links_into_blobs_load(good, tmp_path):
    """The Hugging Face cache layout: snapshots/<rev>/* are links to ../../blobs/<hash>."""
    repo = tmp_path / "models--org--tiny"
    snap, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted(good.iterdir())):
        (blobs / f"blob{i}").write_bytes(f.read_bytes())
        (snap / f.name).symlink_to(f"../../blobs/blob{i}")
    eng = Engine.from_pretrained(snap, threads=1)
    assert eng.config.model_type == "qwen3"


def test_foreign_file_as_shard(good, tmp_path):
    d = copy_dir(good, tmp_path / "m")
    (d / "model.safetensors").write_bytes(b"#!/bin/sh\necho this is not a checkpoint\n" * 3)
    msg = load_error(d)
    first8 = str(struct.unpack("<Q", b"#!/bin/s")[0])
    assert (
        "model.safetensors" in msg and "not a valid safetensors file" in msg and first8 not in msg
    )


@pytest.mark.parametrize(
    "header",
    [
        [1, 2],
        "x",
        {"w": {"dtype": "F32", "shape": ["a"], "data_offsets": [0, 4]}},
        {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0]}},
        {"w": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}},
        {"w": [1, 2, 3]},
    ],
)
def test_bad_header_is_one_clear_error(good, tmp_path, header):
    d = copy_dir(good, tmp_path / "m")
    h = json.dumps(header).encode()
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h + b"\0" * 16)
    msg = load_error(d)
    assert "model.safetensors" in msg and ("header" in msg or "safetensors file" in msg)


def test_header_not_utf8(good, tmp_path):
    d = copy_dir(good, tmp_path / "m")
    h = b'{"\xff\xfe": 1}'
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(h)) + h)
    assert "model.safetensors" in load_error(d)
