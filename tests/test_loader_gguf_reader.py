"""loader._gguf_reader: gguf.GGUFReader with metadata arrays parsed in bulk gives the same
fields (parts, data, types, contents) and the same memory-mapped tensors as the package's."""

from __future__ import annotations

import numpy as np
import pytest

from kestrel_cli import Engine, KestrelError
from kestrel_cli.models.loader import _gguf_reader


def _same(path):
    import gguf

    ours, ref = _gguf_reader(path), gguf.GGUFReader(str(path))
    assert list(ours.fields) == list(ref.fields)
    for k in ref.fields:
        a, b = ours.fields[k], ref.fields[k]
        assert (a.offset, a.data, a.types) == (b.offset, b.data, b.types), k
        assert a.contents() == b.contents(), k
        assert len(a.parts) == len(b.parts), k
        for x, y in zip(a.parts, b.parts):
            assert x.dtype == y.dtype and np.array_equal(x, y), k
    assert len(ours.tensors) == len(ref.tensors)
    for a, b in zip(ours.tensors, ref.tensors):
        assert (a.name, a.tensor_type, a.data_offset) == (b.name, b.tensor_type, b.data_offset)
        assert list(a.shape) == list(b.shape) and a.data.dtype == b.data.dtype
        assert np.array_equal(a.data, b.data)
        assert not a.data.flags.owndata  # still a view of the mapping
    return ours


def test_every_value_type(tmp_path):
    import gguf

    path = tmp_path / "kinds.gguf"
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_array("t.strings", ["a", "", "héllo", "Ġthe", "<|im_end|>"] * 50)
    w.add_array("t.ints", list(range(-5, 300)))
    w.add_array("t.floats", [0.5, -1.25, 3e38])
    w.add_array("t.bools", [True, False, True])
    w.add_array("t.nested", [[1, 2], [3]])
    w.add_string("t.s", "one")
    w.add_uint32("t.u", 7)
    w.add_tensor("a", np.arange(12, dtype=np.float32).reshape(3, 4))
    w.add_tensor("b", np.ones(5, dtype=np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    r = _same(path)
    assert r.fields["t.strings"].contents()[2] == "héllo"
    assert r.fields["t.nested"].contents() == [1, 2, 3]


def test_model_files(tmp_path):
    """A tokenizer-carrying GGUF (vocab, merges, token types) and a qwen3moe one."""
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location(
        "make_random_checkpoint", root / "scripts" / "make_random_checkpoint.py"
    )
    mrc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mrc)
    for shape in ("tiny-qwen3-moe", "tiny-llama"):
        out = tmp_path / f"{shape}.gguf"
        assert mrc.main([str(out), "--shape", shape, "--gguf", "q8_0"]) == 0
        r = _same(out)
        assert len(r.fields["tokenizer.ggml.tokens"].data) == 1024


def test_truncated_string_array(tmp_path):
    """A string array that runs past the end of the file: one KestrelError naming it."""
    import gguf

    path = tmp_path / "cut.gguf"
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_array("tokenizer.ggml.tokens", ["x" * 100] * 100)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 5000])
    with pytest.raises(
        KestrelError, match=r"^cut.gguf: not a valid GGUF file: tokenizer.ggml.tokens"
    ):
        Engine.from_pretrained(path, threads=1)
