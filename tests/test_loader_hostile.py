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
from hostile_seeds import (
    gguf_fields,
    image_bytes,
    join_safetensors,
    patch,
    png_header_only,
    split_safetensors,
    write_gguf,
)
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

    code = str(Path(kestrel_cli.__file__).parents[1])  # the kestrel_cli under test
    env = {**os.environ, "PYTHONPATH": code + os.pathsep + os.environ.get("PYTHONPATH", "")}
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            "from kestrel_cli.cli import main; main()",
            "run",
            "-m",
            str(good),
            "-p",
            "-",
            "-n",
            "1",
            "-t",
            "1",
        ],
        input=b"hi \xff\xfe there",
        capture_output=True,
        env=env,
        timeout=120,
    )
    err = r.stderr.decode()
    assert r.returncode == 1 and "Traceback" not in err, err
    assert err.strip().splitlines()[-1] == "error: the prompt on stdin is not UTF-8 text (byte 3)"


@pytest.mark.parametrize(
    "flags,needle",
    [
        (["--temp", "nan"], "temperature must be a finite number"),
        (["--temp", "inf"], "temperature must be a finite number"),
        (["--temp", "-inf"], "temperature must be a finite number"),
        (["--temp", "-1"], "temperature must be >= 0"),
        (["--repeat-penalty", "nan"], "repeat_penalty must be a finite number"),
        (["--temp", "1", "--seed", "-2"], "--seed must be in 0..2^64-1"),
        (["--temp", "1", "--seed", str(1 << 64)], "--seed must be in 0..2^64-1"),
    ],
)
def test_sampling_flags(good, flags, needle):
    assert needle in cli("run", "-m", good, "-p", "hi", "-n", "1", "-t", "1", *flags)


def test_seed_minus_one_is_random(good):
    r = CliRunner().invoke(
        app,
        ["run", "-m", str(good), "-p", "hi", "-n", "2", "-t", "1", "--temp", "1", "--seed", "-1"],
    )
    assert r.exit_code == 0, (r.output, r.exception)


# ------------------------------------------------------------------ config.json


@pytest.mark.parametrize(
    "over,field",
    [
        ({"rms_norm_eps": -1}, "rms_norm_eps"),
        ({"rms_norm_eps": 0}, "rms_norm_eps"),
        ({"rms_norm_eps": math.nan}, "rms_norm_eps"),
        ({"rms_norm_eps": "x"}, "rms_norm_eps"),
        ({"rope_theta": 0, "rope_parameters": _DROP}, "rope_theta"),
        ({"rope_parameters": {"rope_type": "default", "rope_theta": -5}}, "rope_theta"),
        ({"rope_parameters": {"rope_type": ["default"], "rope_theta": 1e4}}, "rope_type"),
        (
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "rope_theta": 1e4,
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 1.0,
                    "original_max_position_embeddings": 64,
                }
            },
            "high_freq_factor",
        ),
        ({"num_hidden_layers": -1}, "num_hidden_layers"),
        ({"num_hidden_layers": 0}, "num_hidden_layers"),
        ({"num_hidden_layers": True}, "num_hidden_layers"),
        ({"num_hidden_layers": math.inf}, "num_hidden_layers"),
        ({"num_hidden_layers": 10**9}, "num_hidden_layers"),
        ({"hidden_size": 0}, "hidden_size"),
        ({"hidden_size": -64}, "hidden_size"),
        ({"hidden_size": 64.5}, "hidden_size"),
        ({"hidden_size": 10**11}, "hidden_size"),
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
    ],
)
def test_config_values(good, tmp_path, over, field):
    d = with_config(good, tmp_path, **over)
    msg = one_line_error(lambda: Engine.from_pretrained(d, threads=1))
    assert "config.json" in msg and field in msg, msg
    assert field in cli("info", "-m", d)  # info refuses what run refuses


def test_moe_config_values():
    from kestrel_cli.formats.config import Config

    base = dict(
        model_type="qwen3_moe",
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
    )
    for over, field in [
        ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
        ({"num_experts_per_tok": 5}, "num_experts_per_tok"),
        ({"num_experts_per_tok": 0}, "num_experts_per_tok"),
        ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ]:
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


@pytest.mark.parametrize(
    "index,needle",
    [
        ({"weight_map": {"a": ["model.safetensors"]}}, "not a plain file name"),
        ({"weight_map": {}}, "weight_map"),
        ({"weight_map": []}, "weight_map"),
        ([1, 2], "expected a JSON object"),
    ],
)
def test_malformed_index(good, tmp_path, index, needle):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(good, d)
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    msg = one_line_error(lambda: Engine.from_pretrained(d, threads=1))
    assert "model.safetensors.index.json" in msg and needle in msg


# ------------------------------------------------------------------ GGUF


def _gguf_error(tmp_path, data: bytes) -> str:
    from kestrel_cli.models.loader import open_checkpoint

    p = tmp_path / "bad.gguf"
    p.write_bytes(data)
    msg = one_line_error(lambda: open_checkpoint(p))
    assert "bad.gguf: " in msg, msg
    return msg


U64 = (1 << 64) - 1


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("GGUF.tensor_count#0", 1 << 62, "tensor_count"),
        ("GGUF.tensor_count#0", U64, "tensor_count"),
        ("GGUF.kv_count#0", 1 << 62, "kv_count"),
        ("GGUF.kv_count#0", 1000, "metadata key #18"),  # the first kv past the real ones
        # parts of a field: #0 key length, #1 key, #2 value type, then the value; an array's
        # value: #3 item type, #4 length, then its items (a string: #5 length, #6 bytes, ...)
        ("tokenizer.ggml.tokens#4", 1 << 62, "tokenizer.ggml.tokens"),
        ("tokenizer.ggml.tokens#4", 5000, "tokenizer.ggml.tokens"),
        ("tokenizer.ggml.tokens#3", 99, "tokenizer.ggml.tokens"),
        ("tokenizer.ggml.tokens#3", 9, "arrays of arrays"),
        ("tokenizer.ggml.tokens#5", 1 << 40, "tokenizer.ggml.tokens[0]"),
        ("tokenizer.ggml.token_type#4", 1 << 61, "tokenizer.ggml.token_type"),
        ("tokenizer.ggml.token_type#3", 8, "tokenizer.ggml.token_type"),
        ("general.architecture#0", 1 << 40, "metadata key #0"),  # a key's length
        ("general.architecture#2", 77, "general.architecture"),  # the value type
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
    ],
)
def test_gguf_header_fields(seed_gguf, tmp_path, field, value, needle):
    _, data, fields = seed_gguf
    off, size = fields[field]
    msg = _gguf_error(tmp_path, patch(data, off, size, value))
    assert needle in msg, msg


@pytest.mark.parametrize("cut", [3, 20, 100, 3000, -100])
def test_truncated_gguf(seed_gguf, tmp_path, cut):
    _, data, _ = seed_gguf
    _gguf_error(tmp_path, data[:cut])


LLAMA_KV = {
    "llama.block_count": ("uint32", 1),
    "llama.embedding_length": ("uint32", 8),
    "llama.attention.head_count": ("uint32", 2),
    "llama.feed_forward_length": ("uint32", 8),
}


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


@pytest.mark.parametrize(
    "kv,needle",
    [
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
    ],
)
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
    from kestrel_cli.models.images import load_image

    return one_line_error(lambda: load_image(src))


@pytest.mark.parametrize("w,h", [(100_000, 100_000), (1 << 31, 2), (20_000, 6_000)])
def test_image_decompression_bomb_header(w, h):
    msg = _image_error(png_header_only(w, h))
    assert "too large" in msg or "not a readable image" in msg


def test_pillow_limits_are_set_explicitly():
    from PIL import Image, ImageFile

    from kestrel_cli.models import images

    Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = None, True  # as another library might
    try:
        assert "too large" in _image_error(png_header_only(12_000, 12_000))
        good = image_bytes("PNG", (64, 64))
        assert "not a readable image" in _image_error(good[: len(good) // 2])
        assert Image.MAX_IMAGE_PIXELS == images.MAX_DECODE_PIXELS
    finally:
        Image.MAX_IMAGE_PIXELS, ImageFile.LOAD_TRUNCATED_IMAGES = 89_478_485, False


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "GIF", "BMP", "TIFF", "WEBP"])
def test_truncated_and_garbled_images(fmt):
    data = image_bytes(fmt, (40, 30))
    for bad in (data[: len(data) // 3], data[:20], data[:8] + b"\xff" * (len(data) - 8)):
        assert "not a readable image" in _image_error(bad)


@pytest.mark.parametrize(
    "over,field",
    [
        ({"patch_size": 0}, "patch_size"),
        ({"merge_size": -1}, "merge_size"),
        ({"patch_size": "16"}, "patch_size"),
        ({"min_pixels": 0}, "min_pixels"),
        ({"min_pixels": 5000, "max_pixels": 10}, "min_pixels"),
        ({"max_pixels": 10**12}, "max_pixels"),
        ({"image_std": [0.5, 0, 0.5]}, "image_std"),
        ({"image_mean": [0.5]}, "image_mean"),
        ({"size": [1, 2]}, "size"),
        ({"rescale_factor": "x"}, "rescale_factor"),
    ],
)
def test_preprocessor_config_values(tmp_path, over, field):
    from kestrel_cli.models.images import ImageConfig

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
    from kestrel_cli.text.tokenizer import Tokenizer

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


@pytest.mark.parametrize(
    "source,needle",
    [
        ("{{ 1/0 }}", "division by zero"),
        ("{% for i in range(100000000) %}{% endfor %}", "chat template error"),
        ("{{ range(100000000)|list|length }}", "chat template error"),
    ],
)
def test_template_errors_at_the_cli(good, tmp_path, source, needle):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(good, d)
    (d / "chat_template.jinja").write_text(source)
    assert needle in cli("run", "-m", d, "-p", "hi", "-n", "1", "-t", "1")


# ------------------------------------------------------------------ issue 33: round two


def kestrel(*args, timeout=180, input=None) -> subprocess.CompletedProcess:
    """The CLI in a subprocess (the kestrel_cli under test), as a user runs it."""
    import os

    import kestrel_cli

    code = str(Path(kestrel_cli.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": code + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-c", "from kestrel_cli.cli import main; main()", *[str(a) for a in args]],
        input=input,
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def one_error_line(r: subprocess.CompletedProcess) -> str:
    """A failed CLI run: non-zero exit, no traceback, one line on stderr."""
    assert r.returncode != 0 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


# config.json, tokenizer files, templates and the index linked out of the model directory
# are refused as shards already were (a planted link must not make the loader read, or echo
# parts of, a file elsewhere)
OUTSIDE_FILES = {
    "config.json": None,
    "tokenizer.json": None,
    "tokenizer_config.json": None,
    "generation_config.json": '{"eos_token_id": 1}',
    "chat_template.jinja": "{{ messages[0]['content'] }}",
    "additional_chat_templates/tool_use.jinja": "{{ messages }}",
    "model.safetensors.index.json": None,
}


@pytest.mark.parametrize("name", list(OUTSIDE_FILES))
def test_model_files_linked_outside_the_directory(good, tmp_path, name):
    import shutil

    d = tmp_path / "m"
    shutil.copytree(good, d)
    outside = tmp_path / "elsewhere" / Path(name).name
    outside.parent.mkdir()
    if name == "model.safetensors.index.json":
        from safetensors import safe_open

        with safe_open(d / "model.safetensors", "np") as f:
            outside.write_text(
                json.dumps({"weight_map": {k: "model.safetensors" for k in f.keys()}})
            )
    elif OUTSIDE_FILES[name] is None:
        shutil.move(d / name, outside)
    else:
        outside.write_text(OUTSIDE_FILES[name])
        (d / name).unlink(missing_ok=True)
    (d / name).parent.mkdir(exist_ok=True)
    (d / name).symlink_to(outside)
    msg = one_line_error(lambda: Engine.from_pretrained(d, threads=1))
    assert Path(name).name in msg and "outside" in msg, msg
    # the same file as a link inside the directory (or into a HF cache's blobs) is fine
    (d / name).unlink()
    shutil.move(outside, d / "real")
    (d / name).symlink_to(d / "real")
    Engine.from_pretrained(d, threads=1)


def test_preprocessor_config_linked_outside(tmp_path):
    from kestrel_cli.models.images import ImageConfig

    (tmp_path / "m").mkdir()
    (tmp_path / "elsewhere.json").write_text(json.dumps({"patch_size": 16}))
    (tmp_path / "m" / "preprocessor_config.json").symlink_to(tmp_path / "elsewhere.json")
    msg = one_line_error(lambda: ImageConfig.from_dir(tmp_path / "m"))
    assert "preprocessor_config.json" in msg and "outside" in msg


def test_quantize_does_not_write_through_a_planted_part_link(good, tmp_path):
    """OUT.part planted as a link to a victim file: the victim keeps its bytes, OUT is a new
    regular file (the link was neither written through nor renamed into place)."""
    from kestrel_cli.apps.gguf_export import quantize_checkpoint

    victim, out = tmp_path / "victim.txt", tmp_path / "m.gguf"
    victim.write_bytes(b"precious")
    (tmp_path / "m.gguf.part").symlink_to(victim)
    quantize_checkpoint(good, out, "q8_0", threads=1)
    assert victim.read_bytes() == b"precious"
    assert not out.is_symlink() and out.read_bytes()[:4] == b"GGUF"
    assert not (tmp_path / "m.gguf.part").exists() and not (tmp_path / "m.gguf.part").is_symlink()
    # a dangling link (it would create the file it names) fares the same
    (tmp_path / "m.gguf.part").symlink_to(tmp_path / "created-by-the-link")
    quantize_checkpoint(good, out, "q8_0", threads=1)
    assert not (tmp_path / "created-by-the-link").exists() and not out.is_symlink()


def test_quantize_sigterm_removes_the_partial_file(good, tmp_path):
    """SIGTERM mid-write (a service manager stopping it): exit non-zero with one line, no
    OUT.part left, an older OUT untouched."""
    import os
    import signal
    import time

    import kestrel_cli

    out, part = tmp_path / "m.gguf", tmp_path / "m.gguf.part"
    out.write_bytes(b"old")
    slow = (
        "import sys, time; import kestrel_cli.apps.gguf_export as g; real = g.quantize_rows; "
        "g.quantize_rows = lambda x, q: (time.sleep(0.2), real(x, q))[1]; "
        "from kestrel_cli.cli import main; sys.argv = ['kestrel'] + sys.argv[1:]; main()"
    )
    code = str(Path(kestrel_cli.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": code + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen(
        [sys.executable, "-c", slow, "quantize", str(good), str(out), "--type", "q8_0", "-t", "1"],
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 120
        while not (part.exists() and part.stat().st_size > 0):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "OUT.part never appeared"
            time.sleep(0.02)
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    line = one_error_line(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    assert "SIGTERM" in line and str(out) in line, line
    assert proc.returncode == 143  # 128 + SIGTERM, as a shell reports it
    assert not part.exists() and out.read_bytes() == b"old"


@pytest.mark.parametrize(
    "tensor,value",
    [
        ("token_embd.weight", math.nan),
        ("blk.0.attn_k.weight", math.inf),
        ("output_norm.weight", math.inf),
    ],
)
@pytest.mark.parametrize("temp", [0.0, 0.8])
def test_non_finite_weights_refused_when_sampling(tmp_path, tensor, value, temp):
    """NaN/Inf weights give NaN/Inf logits: one ModelError naming the file and the position,
    never a silent argmax over NaN (greedy) or numpy's ValueError (sampling)."""
    from kestrel_cli.core.errors import ModelError

    p = write_gguf(tmp_path / "nan.gguf", hidden=4, ff=4, heads=2, q8=False, poison={tensor: value})
    eng = Engine.from_pretrained(p, threads=1)
    with pytest.raises(ModelError) as e:
        list(eng.generate([0, 1], max_tokens=3, temperature=temp, seed=0))
    msg = str(e.value)
    assert "\n" not in msg and "nan.gguf" in msg, msg
    assert "non-finite logits" in msg and "position 1" in msg, msg


def test_non_finite_weights_at_the_cli(tmp_path):
    p = write_gguf(
        tmp_path / "nan.gguf",
        hidden=4,
        ff=4,
        heads=2,
        q8=False,
        poison={"token_embd.weight": math.nan},
    )
    r = kestrel("run", "-m", p, "-p", "hi", "-n", "2", "--temp", "0", "--no-timing", "-t", "1")
    line = one_error_line(r)
    assert line.startswith("error: ") and "non-finite logits" in line, line


@pytest.mark.parametrize(
    "field,value,needle",
    [
        ("llama.attention.head_count_kv#3", 0, "llama.attention.head_count_kv"),
        ("llama.attention.head_count_kv#3", 3, "llama.attention.head_count_kv"),
        ("llama.attention.head_count_kv#3", 1 << 31, "llama.attention.head_count_kv"),
        ("llama.attention.head_count#3", 1 << 20, "llama.attention.head_count"),
        ("llama.attention.head_count#3", 3, "llama.attention.head_count"),
    ],
)
def test_gguf_head_counts(seed_gguf, tmp_path, field, value, needle):
    _, data, fields = seed_gguf
    msg = _gguf_error(tmp_path, patch(data, *fields[field], value))
    assert needle in msg, msg


def test_gguf_missing_tensor_names_the_file(seed_gguf, tmp_path):
    """block_count 2 in a one-layer file (the fuzzer's find): the error names the file."""
    _, data, fields = seed_gguf
    p = tmp_path / "two.gguf"
    p.write_bytes(patch(data, *fields["llama.block_count#3"], 2))
    msg = one_line_error(lambda: Engine.from_pretrained(p, threads=1))
    assert "missing tensor 'model.layers.1." in msg and "two.gguf" in msg, msg


@pytest.mark.parametrize("command", ["run", "info"])
def test_gguf_head_count_kv_0_at_the_cli(seed_gguf, tmp_path, command):
    """Was a ZeroDivisionError traceback in both."""
    _, data, fields = seed_gguf
    p = tmp_path / "kv0.gguf"
    p.write_bytes(patch(data, *fields["llama.attention.head_count_kv#3"], 0))
    extra = ["-p", "hi", "-n", "1", "-t", "1", "--no-timing"] if command == "run" else []
    line = one_error_line(kestrel(command, "-m", p, *extra))
    assert "kv0.gguf" in line and "head_count_kv" in line, line


@pytest.mark.parametrize(
    "over,field",
    [
        ({"num_attention_heads": 1 << 20}, "num_attention_heads"),
        (
            {"num_attention_heads": 1 << 20, "num_key_value_heads": 1 << 20, "head_dim": 2},
            "num_attention_heads",
        ),
        ({"head_dim": 1 << 20}, "head_dim"),
    ],
)
def test_config_absurd_head_counts(good, tmp_path, over, field):
    d = with_config(good, tmp_path, **over)
    msg = one_line_error(lambda: Engine.from_pretrained(d, threads=1))
    assert "config.json" in msg and field in msg, msg


# error lines echo a hostile file's shapes, names and dtypes cut short, never whole
@pytest.mark.parametrize(
    "entry",
    [
        {"shape": [3] * 100_000},  # was a 300 KB line, or a ValueError
        {"shape": [1] * 100_000},
        {"shape": [1] * 100},  # past numpy's 64 dimensions
        {"shape": [7, 1 << 40, 3]},
        {"dtype": "F" * 100_000},
    ],
)
def test_safetensors_echoes_are_bounded(tmp_path, entry):
    from hostile_seeds import write_safetensors
    from kestrel_cli.models.loader import TensorStore, _open_safetensors

    p = write_safetensors(tmp_path / "x.safetensors")
    header, body = split_safetensors(p.read_bytes())
    header["a.weight"].update(entry)
    p.write_bytes(join_safetensors(header, body))

    def load():
        store = TensorStore()
        _open_safetensors(p, store)
        store.matrix("a.weight", (4, 32))

    msg = one_line_error(load)
    assert "x.safetensors" in msg and len(msg) < 400, msg[:500]


@pytest.mark.parametrize("digits", [4000, 5000])
def test_huge_integers_in_json(good, tmp_path, digits):
    """A 4000-digit dimension was echoed whole (8 KB); past Python's 4300-digit limit on
    int parsing json raised a bare ValueError (a traceback), in config.json too."""
    import shutil

    from hostile_seeds import write_safetensors
    from kestrel_cli.models.loader import TensorStore, _open_safetensors

    p = write_safetensors(tmp_path / "x.safetensors")
    header, body = split_safetensors(p.read_bytes())
    raw = (
        json.dumps(header)
        .encode()
        .replace(b'"shape": [4, 32]', b'"shape": [4, ' + b"9" * digits + b"]")
    )
    p.write_bytes(struct.pack("<Q", len(raw)) + raw + body)
    msg = one_line_error(lambda: _open_safetensors(p, TensorStore()))
    assert "x.safetensors" in msg and len(msg) < 400, msg[:500]
    d = tmp_path / "m"
    shutil.copytree(good, d)
    (d / "config.json").write_text('{"model_type": "qwen3", "hidden_size": ' + "9" * digits + "}")
    msg = one_line_error(lambda: Engine.from_pretrained(d, threads=1))
    assert "config.json" in msg and len(msg) < 400, msg[:500]
    # the tokenizer's own JSON files (generation_config.json, tokenizer_config.json) too
    shutil.copy(good / "config.json", d / "config.json")
    (d / "generation_config.json").write_text('{"eos_token_id": ' + "9" * digits + "}")
    if digits > 4300:
        msg = one_line_error(lambda: Engine.from_pretrained(d, threads=1))
        assert "generation_config.json" in msg and len(msg) < 400, msg[:500]


def test_long_gguf_names_are_cut(tmp_path):
    """An architecture or tensor name of 60 KB is cut in the error line."""
    data = _gguf_with(tmp_path, {"general.architecture": ("string", "x" * 60_000)})
    assert len(_gguf_error(tmp_path, data)) < 400
    data = _gguf_with(tmp_path, {}, tensors=(("t" * 60_000, (4, 8)),))
    assert len(_gguf_error(tmp_path, data)) < 400


def test_long_tensor_name_is_cut(tmp_path):
    from hostile_seeds import write_safetensors
    from kestrel_cli.models.loader import TensorStore, _open_safetensors

    name = "w" * 100_000
    p = write_safetensors(tmp_path / "x.safetensors", {name: np.zeros((4, 32), np.float32)})
    header, body = split_safetensors(p.read_bytes())
    header[name]["data_offsets"] = [0, 1 << 40]
    p.write_bytes(join_safetensors(header, body))
    msg = one_line_error(lambda: _open_safetensors(p, TensorStore()))
    assert "x.safetensors" in msg and len(msg) < 400, msg[:500]
    p = write_safetensors(tmp_path / "x.safetensors", {name: np.zeros((4, 32), np.float32)})
    store = TensorStore()
    _open_safetensors(p, store)
    msg = one_line_error(lambda: store.matrix(name, (8, 32)))
    assert len(msg) < 400, msg[:500]
