"""Hostile files and flags (issue 16): each bad value a probe found is one KestrelError naming
the file and the field (one line, exit 1 at the CLI), never a traceback, a hang or a huge
allocation."""
from __future__ import annotations

import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from conftest import VOCAB, make_checkpoint
from hostile_seeds import (gguf_fields, image_bytes, join_safetensors, patch, png_header_only,
                           split_safetensors, write_gguf)
from kestrel_cli import Engine, KestrelError
from kestrel_cli.cli import app


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    d = tmp_path_factory.mktemp("good")
    make_checkpoint(d, "qwen3")
    return d


@pytest.fixture(scope="module")
def seed_gguf(tmp_path_factory):
    p = write_gguf(tmp_path_factory.mktemp("gguf") / "seed.gguf")
    return p, p.read_bytes(), gguf_fields(p)


def one_line_error(fn) -> str:
    with pytest.raises(KestrelError) as e:
        fn()
    msg = str(e.value)
    assert msg and "\n" not in msg and "Traceback" not in msg, msg
    return msg


def cli(*args, input=None):
    r = CliRunner().invoke(app, [str(a) for a in args], input=input)
    assert r.exit_code == 1, (r.exit_code, r.output, r.exception)
    assert isinstance(r.exception, SystemExit) and "Traceback" not in r.output, r.output
    lines = [ln for ln in r.output.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, r.output
    return lines[0]


def with_config(good, tmp_path, **over):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(good, d)
    cfg = json.loads((d / "config.json").read_text())
    for k, v in over.items():
        if v is _DROP:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    return d


_DROP = object()


# ------------------------------------------------------------------ the CLI's own inputs

def test_stdin_prompt_not_utf8(good):
    import os

    import kestrel_cli
    code = str(Path(kestrel_cli.__file__).parents[1])        # the kestrel_cli under test
    env = {**os.environ, "PYTHONPATH": code + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run([sys.executable, "-c", "from kestrel_cli.cli import main; main()", "run",
                        "-m", str(good), "-p", "-", "-n", "1", "-t", "1"],
                       input=b"hi \xff\xfe there", capture_output=True, env=env, timeout=120)
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "error: the prompt on stdin is not UTF-8 text (byte 3)"


@pytest.mark.parametrize("flags,needle", [
    (["--temp", "nan"], "temperature must be a finite number"),
    (["--temp", "inf"], "temperature must be a finite number"),
    (["--temp", "-inf"], "temperature must be a finite number"),
    (["--temp", "-1"], "temperature must be >= 0"),
    (["--repeat-penalty", "nan"], "repeat_penalty must be a finite number"),
    (["--temp", "1", "--seed", "-2"], "--seed must be in 0..2^64-1"),
    (["--temp", "1", "--seed", str(1 << 64)], "--seed must be in 0..2^64-1"),
])
def test_sampling_flags(good, flags, needle):
    assert needle in cli("run", "-m", good, "-p", "hi", "-n", "1", "-t", "1", *flags)


def test_seed_minus_one_is_random(good):
    r = CliRunner().invoke(app, ["run", "-m", str(good), "-p", "hi", "-n", "2", "-t", "1",
                                 "--temp", "1", "--seed", "-1"])
    assert r.exit_code == 0, (r.output, r.exception)


# ------------------------------------------------------------------ config.json

@pytest.mark.parametrize("over,field", [
    ({"rms_norm_eps": -1}, "rms_norm_eps"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
    ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
    ({"rms_norm_eps": "x"}, "rms_norm_eps"),
    ({"rope_theta": 0, "rope_parameters": _DROP}, "rope_theta"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -5}}, "rope_theta"),
    ({"rope_parameters": {"rope_type": ["default"], "rope_theta": 1e4}}, "rope_type"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0,
                          "low_freq_factor": 1.0, "high_freq_factor": 1.0,
                          "original_max_position_embeddings": 64}}, "high_freq_factor"),
    ({"num_hidden_layers": -1}, "num_hidden_layers"),
    ({"num_hidden_layers": 0}, "num_hidden_layers"),
    ({"num_hidden_layers": True}, "num_hidden_layers"),
    ({"num_hidden_layers": math.inf}, "num_hidden_layers"),
    ({"num_hidden_layers": 10 ** 9}, "num_hidden_layers"),
    ({"hidden_size": 0}, "hidden_size"),
    ({"hidden_size": -64}, "hidden_size"),
    ({"hidden_size": 64.5}, "hidden_size"),
    ({"hidden_size": 10 ** 11}, "hidden_size"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_key_value_heads": -2}, "num_key_value_heads"),
    ({"num_key_value_heads": 8}, "num_key_value_heads"),
    ({"head_dim": -1}, "head_dim"),
    ({"head_dim": 23}, "head_dim"),
    ({"intermediate_size": -1}, "intermediate_size"),
    ({"max_position_embeddings": -5}, "max_position_embeddings"),
    ({"max_position_embeddings": 0}, "max_position_embeddings"),
    ({"max_position_embeddings": 1 << 40}, "max_position_embeddings"),
    ({"layer_types": [[1]]}, "layer_types"),
    ({"mlp_only_layers": "all"}, "mlp_only_layers"),
    ({"vocab_size": 10}, "vocab_size"),
    ({"vocab_size": -1}, "vocab_size"),
])
def test_config_values(good, tmp_path, over, field):
    d = with_config(good, tmp_path, **over)
    msg = one_line_error(lambda: Engine.from_pretrained(d, threads=1))
    assert "config.json" in msg and field in msg, msg
    assert field in cli("info", "-m", d)          # info refuses what run refuses


def test_moe_config_values():
    from kestrel_cli.config import Config
    base = dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_experts=4, num_experts_per_tok=2,
                moe_intermediate_size=32)
    for over, field in [({"decoder_sparse_step": 0}, "decoder_sparse_step"),
                        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
                        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
                        ({"moe_intermediate_size": 0}, "moe_intermediate_size")]:
        assert field in one_line_error(lambda: Config.from_hf({**base, **over}))


def test_info_validates_what_run_would(good, tmp_path):
    """0 is the default for num_key_value_heads: the config is fine, the tensors are not."""
    d = with_config(good, tmp_path, num_key_value_heads=0)
    assert "k_proj.weight" in cli("info", "-m", d)


def test_short_embedding_vs_tokenizer(good, tmp_path):
    from safetensors.numpy import load_file, save_file
    d = with_config(good, tmp_path, vocab_size=10)
    t = load_file(str(d / "model.safetensors"))
    for k in ("model.embed_tokens.weight", "lm_head.weight"):
        t[k] = t[k][:10].copy()
    save_file(t, str(d / "model.safetensors"))
    msg = one_line_error(lambda: Engine.from_pretrained(d, threads=1))
    assert "vocab_size=10" in msg and "tokenizer" in msg


def test_token_ids_past_the_embedding(good):
    eng = Engine.from_pretrained(good, threads=1)
    for ids in ([VOCAB + 5], [1, 2, -1]):
        assert "out of range" in one_line_error(lambda: eng.prefill(ids))


@pytest.mark.parametrize("name", ["config.json", "model.safetensors.index.json"])
def test_deeply_nested_json(good, tmp_path, name):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(good, d)
    (d / name).write_text("[" * 100000 + "]" * 100000)
    msg = one_line_error(lambda: Engine.from_pretrained(d, threads=1))
    assert name in msg


# ------------------------------------------------------------------ safetensors and the index

def _edit_header(good, tmp_path, edit):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(good, d)
    header, body = split_safetensors((d / "model.safetensors").read_bytes())
    edit(header)
    (d / "model.safetensors").write_bytes(join_safetensors(header, body))
    return d


def test_overlapping_tensors(good, tmp_path):
    def edit(h):
        h["lm_head.weight"]["data_offsets"] = h["model.embed_tokens.weight"]["data_offsets"]
    d = _edit_header(good, tmp_path, edit)
    msg = one_line_error(lambda: Engine.from_pretrained(d, threads=1))
    assert "model.safetensors" in msg and "overlaps" in msg


def test_nested_header(good, tmp_path):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(good, d)
    raw = b"[" * 200000 + b"]" * 200000
    (d / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    assert "model.safetensors" in one_line_error(lambda: Engine.from_pretrained(d, threads=1))


@pytest.mark.parametrize("index,needle", [
    ({"weight_map": {"a": ["model.safetensors"]}}, "not a plain file name"),
    ({"weight_map": {}}, "weight_map"),
    ({"weight_map": []}, "weight_map"),
    ([1, 2], "expected a JSON object"),
])
def test_malformed_index(good, tmp_path, index, needle):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(good, d)
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = one_line_error(lambda: Engine.from_pretrained(d, threads=1))
    assert "model.safetensors.index.json" in msg and needle in msg


# ------------------------------------------------------------------ GGUF

def _gguf_error(tmp_path, data: bytes) -> str:
    from kestrel_cli.loader import open_checkpoint
    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    msg = one_line_error(lambda: open_checkpoint(p))
    assert "bad.gguf: " in msg, msg
    return msg


U64 = (1 << 64) - 1


@pytest.mark.parametrize("field,value,needle", [
    ("GGUF.tensor_count#0", 1 << 62, "tensor_count"),
    ("GGUF.tensor_count#0", U64, "tensor_count"),
    ("GGUF.kv_count#0", 1 << 62, "kv_count"),
    ("GGUF.kv_count#0", 1000, "metadata key #18"),      # the first kv past the real ones
    # parts of a field: #0 key length, #1 key, #2 value type, then the value; an array's
    # value: #3 item type, #4 length, then its items (a string: #5 length, #6 bytes, ...)
    ("tokenizer.ggml.tokens#4", 1 << 62, "tokenizer.ggml.tokens"),
    ("tokenizer.ggml.tokens#4", 5000, "tokenizer.ggml.tokens"),
    ("tokenizer.ggml.tokens#3", 99, "tokenizer.ggml.tokens"),
    ("tokenizer.ggml.tokens#3", 9, "arrays of arrays"),
    ("tokenizer.ggml.tokens#5", 1 << 40, "tokenizer.ggml.tokens[0]"),
    ("tokenizer.ggml.token_type#4", 1 << 61, "tokenizer.ggml.token_type"),
    ("tokenizer.ggml.token_type#3", 8, "tokenizer.ggml.token_type"),
    ("general.architecture#0", 1 << 40, "metadata key #0"),            # a key's length
    ("general.architecture#2", 77, "general.architecture"),            # the value type
    ("llama.block_count#2", 99, "llama.block_count"),
    ("tensor:blk.0.attn_q.weight#2", 0, "n_dims=0"),
    ("tensor:blk.0.attn_q.weight#2", 9, "n_dims=9"),
    ("tensor:blk.0.attn_q.weight#dim0", 0, "dims"),
    ("tensor:blk.0.attn_q.weight#dim1", 1 << 50, "dims"),
    ("tensor:blk.0.attn_q.weight#dim1", 1 << 30, "past the end"),
    ("tensor:blk.0.attn_q.weight#dim0", 33, "blocks of 32"),
    ("tensor:blk.0.attn_q.weight#4", 1234, "unknown ggml type"),
    ("tensor:blk.0.attn_q.weight#5", 1 << 50, "past the end"),
    ("tensor:blk.0.attn_q.weight#5", 7, "alignment"),
    ("tensor:blk.0.attn_q.weight#5", 0, "overlap"),
])
def test_gguf_header_fields(seed_gguf, tmp_path, field, value, needle):
    _, data, fields = seed_gguf
    off, size = fields[field]
    msg = _gguf_error(tmp_path, patch(data, off, size, value))
    assert needle in msg, msg


@pytest.mark.parametrize("cut", [3, 20, 100, 3000, -100])
def test_truncated_gguf(seed_gguf, tmp_path, cut):
    _, data, _ = seed_gguf
    _gguf_error(tmp_path, data[:cut])


LLAMA_KV = {"llama.block_count": ("uint32", 1), "llama.embedding_length": ("uint32", 8),
            "llama.attention.head_count": ("uint32", 2), "llama.feed_forward_length": ("uint32", 8)}


def _gguf_with(tmp_path, kv: dict, tensors=(("token_embd.weight", (4, 8)),)):
    import gguf
    p = tmp_path / "bad.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    for k, (kind, v) in {**LLAMA_KV, **kv}.items():
        getattr(w, f"add_{kind}")(k, v)
    for name, shape in tensors:
        w.add_tensor(name, np.zeros(shape, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p.read_bytes()


@pytest.mark.parametrize("kv,needle", [
    ({"general.alignment": ("uint32", 0)}, "general.alignment"),
    ({"general.alignment": ("uint32", 24)}, "general.alignment"),
    ({"general.alignment": ("string", "32")}, "general.alignment"),
    ({"llama.block_count": ("string", "two")}, "llama.block_count"),
    ({"llama.block_count": ("array", [1, 2])}, "llama.block_count"),
    ({"llama.attention.head_count": ("uint32", 0)}, "num_attention_heads"),
    ({"llama.attention.head_count": ("float32", 2.0)}, "llama.attention.head_count"),
    ({"llama.attention.layer_norm_rms_epsilon": ("float32", -1.0)}, "rms_norm_eps"),
    ({"llama.attention.layer_norm_rms_epsilon": ("string", "x")}, "layer_norm_rms_epsilon"),
    ({"llama.rope.freq_base": ("float32", 0.0)}, "rope_theta"),
    ({"llama.block_count": ("uint64", 1 << 40)}, "num_hidden_layers"),
    ({"llama.context_length": ("int32", -4)}, "max_position_embeddings"),
    ({"general.architecture": ("array", ["llama"])}, "architecture"),
])
def test_gguf_metadata_values(tmp_path, kv, needle):
    msg = _gguf_error(tmp_path, _gguf_with(tmp_path, kv))
    assert needle in msg, msg


def test_gguf_stock_error_reads_like_numpy_no_more(tmp_path):
    """The issue's example: absurd counts gave "index 0 is out of bounds for axis 0"."""
    data = b"GGUF" + struct.pack("<IQQ", 3, U64, 0) + b"\0" * 64
    msg = _gguf_error(tmp_path, data)
    assert "tensor_count" in msg and "out of bounds" not in msg


# ------------------------------------------------------------------ images

def _image_error(src) -> str:
    from kestrel_cli.images import load_image
    return one_line_error(lambda: load_image(src))


@pytest.mark.parametrize("w,h", [(100_000, 100_000), (1 << 31, 2), (20_000, 6_000)])
def test_image_decompression_bomb_header(w, h):
    msg = _image_error(png_header_only(w, h))
    assert "too large" in msg or "not a readable image" in msg


def test_pillow_limits_are_set_explicitly():
    from PIL import Image, ImageFile

    from kestrel_cli import images
    Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = None, True   # as another library might
    try:
        assert "too large" in _image_error(png_header_only(12_000, 12_000))
        good = image_bytes("PNG", (64, 64))
        assert "not a readable image" in _image_error(good[:len(good) // 2])
        assert Image.MAX_IMAGE_PIXELS == images.MAX_DECODE_PIXELS
    finally:
        Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = 89_478_485, False


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP"])
def test_truncated_and_garbled_images(fmt):
    data = image_bytes(fmt, (40, 30))
    for bad in (data[:len(data) // 3], data[:20], data[:8] + b"\xff" * (len(data) - 8)):
        assert "not a readable image" in _image_error(bad)


@pytest.mark.parametrize("over,field", [
    ({"patch_size": 0}, "patch_size"), ({"merge_size": -1}, "merge_size"),
    ({"patch_size": "16"}, "patch_size"), ({"min_pixels": 0}, "min_pixels"),
    ({"min_pixels": 5000, "max_pixels": 10}, "min_pixels"),
    ({"max_pixels": 10 ** 12}, "max_pixels"), ({"image_std": [0.5, 0, 0.5]}, "image_std"),
    ({"image_mean": [0.5]}, "image_mean"), ({"size": [1, 2]}, "size"),
    ({"rescale_factor": "x"}, "rescale_factor"),
])
def test_preprocessor_config_values(tmp_path, over, field):
    from kestrel_cli.images import ImageConfig
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(over))
    msg = one_line_error(lambda: ImageConfig.from_dir(tmp_path))
    assert "preprocessor_config.json" in msg and field in msg


# ------------------------------------------------------------------ chat templates (sandbox)

ESCAPES = [
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ [].__class__.__base__.__subclasses__() }}",
    "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "{{ joiner.__init__.__globals__ }}",
    "{{ namespace.__init__.__globals__ }}",
    "{{ lipsum.__globals__['os'].popen('id').read() }}",
    "{{ self.__init__.__globals__ }}",
    "{{ self._TemplateReference__context }}",
    "{{ raise_exception.__globals__ }}",
    "{{ strftime_now.__globals__ }}",
    "{{ ''|attr('__class__') }}",
    "{{ ''['__class__'] }}",
    "{{ '{0.__class__}'.format('') }}",
    "{{ '{0.__class__.__mro__}'.format('') }}",
    "{{ '%s' % ''.__class__ }}",
    "{{ 'a'.format.__self__ }}",
    "{% set x = messages.append(1) %}{{ messages }}",
    "{% set d = {} %}{{ d.update(a=1) }}",
    "{% macro m() %}x{% endmacro %}{{ m._func.__globals__ }}",
    "{% import 'os' as os %}",
    "{% include '/etc/passwd' %}",
    "{% extends '/etc/passwd' %}",
    "{{ config }}{{ request }}{{ self.__dict__ }}",
]


@pytest.fixture(scope="module")
def tok(good):
    from kestrel_cli.tokenizer import Tokenizer
    return Tokenizer.from_dir(good)


@pytest.mark.parametrize("source", ESCAPES)
def test_template_escapes_fail_cleanly(tok, source):
    msgs = [{"role": "user", "content": "hi"}]
    try:
        out = tok.apply_chat_template(msgs, chat_template=source)
    except KestrelError as e:
        assert str(e).startswith("chat template error:") and "\n" not in str(e)
        return
    for leak in ("<class", "<function", "<module", "<built-in", "uid=", "root:", "object at 0x"):
        assert leak not in out, out


@pytest.mark.parametrize("source,needle", [
    ("{{ 1/0 }}", "division by zero"),
    ("{% for i in range(100000000) %}{% endfor %}", "chat template error"),
    ("{{ range(100000000)|list|length }}", "chat template error"),
])
def test_template_errors_at_the_cli(good, tmp_path, source, needle):
    import shutil
    d = tmp_path / "m"
    shutil.copytree(good, d)
    (d / "chat_template.jinja").write_text(source)
    assert needle in cli("run", "-m", d, "-p", "hi", "-n", "1", "-t", "1")
