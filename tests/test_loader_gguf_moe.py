"""GGUF qwen3moe and qwen3vl: tiny transformers checkpoints written as llama.cpp lays them
out (scripts/make_random_checkpoint.py's writer, the checkpoint's own values), against
transformers' logits; the experts as views of the mapped file; routing reads only the
selected experts; inconsistent expert metadata."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from conftest import assert_prefill_then_decode_equals_full, make_checkpoint, rand_ids
from kestrel_cli import Engine, KestrelError
from kestrel_cli.inference.engine import LoadOptions
from kestrel_cli.models.loader import open_checkpoint

ROOT = Path(__file__).resolve().parents[1]
GGUF_VOCAB = 1024  # the writer's tokenizer has 1000 tokens: the vocab must hold them
N = 40
ATOL = 1e-4  # as test_models: fp32 logits, max abs difference


def _script():
    spec = importlib.util.spec_from_file_location(
        "make_random_checkpoint", ROOT / "scripts" / "make_random_checkpoint.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


mrc = _script()


def to_gguf(d: Path, out: Path, gtype: str = "f32") -> Path:
    """The transformers checkpoint in `d` as a GGUF of `gtype`, its values unchanged."""
    config = json.loads((d / "config.json").read_text())
    _, store, _, _ = open_checkpoint(d)

    def values(name, shape):
        fmt, raw, actual, _ = store.entries[name]
        assert tuple(actual) == tuple(shape), name
        yield np.asarray(raw, np.float32).reshape(shape)

    mrc.write_gguf(
        out, config, mrc.text_tensors(config), gtype, "f32", None, 0.0, "tiny", values=values
    )
    return out


def hf_logits(model, ids):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits[0].float().numpy()


@pytest.fixture(scope="module", params=[[], [1]], ids=["all-moe", "dense-layer-1"])
def moe(request, tmp_path_factory):
    """A tiny Qwen3MoeForCausalLM (6 experts, top-2, 2 layers; llama.cpp's layout has every
    layer sparse, the second case keeps layer 1 dense) and its f32 / q8_0 GGUFs."""
    d = tmp_path_factory.mktemp("moe")
    model = make_checkpoint(
        d / "hf", "qwen3_moe", vocab_size=GGUF_VOCAB, mlp_only_layers=request.param
    )
    for t in ("f32", "q8_0"):
        to_gguf(d / "hf", d / f"m.{t}.gguf", t)
    return d, model, request.param


def test_moe_gguf_logits_match_transformers(moe):
    d, model, dense = moe
    eng = Engine.from_pretrained(d / "m.f32.gguf", threads=2)
    assert eng.config.model_type == "qwen3_moe" and eng.config.num_experts == 6
    assert eng.config.num_experts_per_tok == 2 and eng.config.norm_topk_prob
    assert eng.config.mlp_only_layers == dense
    ids = rand_ids(N, seed=1)
    ref = hf_logits(model, ids)
    diff = float(np.abs(eng.logits(ids) - ref).max())
    assert diff < ATOL, diff
    q8 = Engine.from_pretrained(d / "m.q8_0.gguf", threads=2, act="f32")  # parity: exact path
    assert q8.model.layers[0].mlp.experts[5].down_proj.fmt == "q8_0"
    assert np.corrcoef(q8.logits(ids).ravel(), ref.ravel())[0, 1] > 0.99


def test_moe_gguf_prefill_then_decode(moe):
    d, _, _ = moe
    eng = Engine.from_pretrained(d / "m.q8_0.gguf", threads=2)
    assert_prefill_then_decode_equals_full(eng, rand_ids(N, seed=2))


def test_experts_are_views_of_the_mapped_file(moe):
    """Without --repack (which moves q4 / q8_0 experts into the x16 layout when they fit
    the memory) each expert's matrix is a slice of the stacked tensor in the memory-mapped
    file (one mapping for all, expert e at e * its size): no copy."""
    import mmap

    import gguf

    d, _, _ = moe
    path = d / "m.q8_0.gguf"
    eng = Engine.from_pretrained(path, threads=1, repack=False)
    on_disk = np.fromfile(path, np.uint8)
    stacked = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    block = eng.model.layers[0].mlp
    roots = set()
    for proj, g in (
        ("gate_proj", "ffn_gate_exps"),
        ("up_proj", "ffn_up_exps"),
        ("down_proj", "ffn_down_exps"),
    ):
        first = getattr(block.experts[0], proj).data
        for e, ex in enumerate(block.experts):
            a = getattr(ex, proj).data
            assert not a.flags.owndata and a.flags.c_contiguous
            root = a
            while not isinstance(root, mmap.mmap):
                root = root.base
            roots.add(id(root))
            assert a.ctypes.data - first.ctypes.data == e * a.nbytes
            off = int(stacked[f"blk.0.{g}.weight"].data_offset) + e * a.nbytes
            assert np.array_equal(a.reshape(-1), on_disk[off : off + a.nbytes])
    assert len(roots) == 1


def test_routing_reads_only_the_selected_experts(moe, monkeypatch):
    """Decode multiplies by the weights of top_k experts per sparse layer, no others; prefill
    runs each sparse layer's experts in one call, each expert at most once with all of its
    tokens grouped, and never the per-expert projections."""
    from kestrel_cli.runtime import kernels

    d, _, dense = moe
    eng = Engine.from_pretrained(d / "m.q8_0.gguf", threads=1)
    sparse = [i for i in range(len(eng.model.layers)) if i not in dense]
    owner = set()  # the experts' own Projections
    for i in sparse:
        for ex in eng.model.layers[i].mlp.experts:
            owner |= {id(ex.gate_up), id(ex.down)}
    calls = []
    orig = kernels.Projection.__call__

    def spy(self, x, *args, **kw):
        if id(self) in owner:
            calls.append(x.shape[0])
        return orig(self, x, *args, **kw)

    monkeypatch.setattr(kernels.Projection, "__call__", spy)
    tables = {id(eng.model.layers[i].mlp.table): i for i in sparse}
    prefills = []
    orig_prefill = kernels.ExpertTable.prefill

    def spy_prefill(self, x, experts, starts, rows, *args, **kw):
        prefills.append((tables[id(self)], list(experts), np.diff(starts).tolist(), list(rows)))
        return orig_prefill(self, x, experts, starts, rows, *args, **kw)

    monkeypatch.setattr(kernels.ExpertTable, "prefill", spy_prefill)
    ids = rand_ids(12, seed=3)
    eng.prefill(ids)
    assert calls == []
    assert sorted(i for i, *_ in prefills) == sparse
    for _, experts, counts, rows in prefills:
        assert experts == sorted(set(experts)) and len(experts) <= 6 and min(counts) > 0
        assert sum(counts) == 12 * 2  # every token routed to 2 experts
        for s0, n in zip(np.cumsum([0] + counts), counts):  # an expert's tokens: distinct
            assert len(set(rows[s0 : s0 + n])) == n
    picked = []
    orig_decode = kernels.ExpertTable.decode

    def spy_decode(self, x, sel, *args, **kw):
        picked.append((tables[id(self)], [int(e) for e in sel]))
        return orig_decode(self, x, sel, *args, **kw)

    monkeypatch.setattr(kernels.ExpertTable, "decode", spy_decode)
    eng.model.native_decode = False  # the Python layer loop (the native decode
    eng.decode_step(ids[-1])  # runs the same kernel: test_native_decode)
    assert calls == []  # decode: no per-expert projection calls
    # one fused call a sparse layer, with its top_k = 2 distinct experts, ascending
    assert sorted(i for i, _ in picked) == sparse
    for _, sel in picked:
        assert len(set(sel)) == 2 and sel == sorted(sel)


# ---------------------------------------------------------------- qwen3vl


def test_qwen3vl_gguf_logits_match_transformers(tmp_path):
    """Qwen3-VL's text decoder as convert_hf_to_gguf writes it (arch qwen3vl, interleaved M-RoPE
    sections): with text positions it is plain RoPE, and Kestrel runs it as qwen3."""
    import gguf

    model = make_checkpoint(tmp_path / "hf", "qwen3_vl", vocab_size=GGUF_VOCAB)
    path = to_gguf(tmp_path / "hf", tmp_path / "vl.gguf")
    r = gguf.GGUFReader(str(path))
    assert r.fields["general.architecture"].contents() == "qwen3vl"
    assert r.fields["qwen3vl.rope.dimension_sections"].contents() == [8, 4, 4, 0]
    eng = Engine.from_pretrained(path, threads=2)
    assert eng.config.model_type == "qwen3"
    assert eng.config.rope["rope_theta"] == 500000.0
    ids = rand_ids(N, seed=4)
    diff = float(np.abs(eng.logits(ids) - hf_logits(model, ids)).max())
    assert diff < ATOL, diff


# ---------------------------------------------------------------- bad metadata


@pytest.fixture(scope="module")
def small_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    out = d / "ok.gguf"
    assert (
        mrc.main([str(out), "--shape", "tiny-qwen3-moe", "--dtype", "f32", "--gguf", "q8_0"]) == 0
    )
    return out


def _edited(src: Path, dst: Path, key: str, value=None, rename: str | None = None) -> Path:
    """A copy of src with one integer metadata value changed, or its key renamed (same length)."""
    import shutil

    import gguf

    shutil.copy(src, dst)
    r = gguf.GGUFReader(str(dst), "r+")
    f = r.fields[key]
    if rename is not None:
        assert len(rename) == len(key)
        f.parts[1][:] = np.frombuffer(rename.encode(), np.uint8)
    else:
        f.parts[f.data[0]][0] = value
    r.data.flush()
    return dst


@pytest.mark.parametrize(
    "key, value, rename, needle",
    [
        (
            "qwen3moe.expert_count",
            3,
            None,
            "blk.0.ffn_gate_inp.weight routes to 4 experts, qwen3moe.expert_count is 3",
        ),
        (
            "qwen3moe.expert_used_count",
            5,
            None,
            "qwen3moe.expert_used_count=5 must be in 1..qwen3moe.expert_count=4",
        ),
        ("qwen3moe.expert_used_count", 0, None, "qwen3moe.expert_used_count=0 must be in 1.."),
        (
            "qwen3moe.expert_feed_forward_length",
            48,
            None,
            "blk.0.ffn_gate_exps.weight has expert MLP size 64, "
            "qwen3moe.expert_feed_forward_length is 48",
        ),
        (
            "qwen3moe.expert_count",
            None,
            "qwen3moe.expert_cnnnt",
            "qwen3moe.expert_count and qwen3moe.expert_used_count are required",
        ),
    ],
)
def test_inconsistent_expert_metadata(small_moe, tmp_path, key, value, rename, needle):
    path = _edited(small_moe, tmp_path / "bad.gguf", key, value, rename)
    with pytest.raises(KestrelError) as e:
        Engine.from_pretrained(path, threads=1)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("bad.gguf: inconsistent MoE metadata: ")
    assert needle in msg, msg


def test_shared_experts_refused(tmp_path):
    """Keys this MoE does not compute are refused, not ignored (here: shared experts)."""
    import gguf

    path = tmp_path / "shared.gguf"
    w = gguf.GGUFWriter(path, "qwen3moe")
    for k, v in (
        ("block_count", 1),
        ("embedding_length", 64),
        ("attention.head_count", 4),
        ("expert_count", 4),
        ("expert_used_count", 2),
        ("expert_shared_count", 1),
    ):
        w.add_uint32(f"qwen3moe.{k}", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(
        KestrelError,
        match="shared.gguf: inconsistent MoE metadata: "
        "qwen3moe.expert_shared_count=1: shared experts are not supported",
    ):
        Engine.from_pretrained(path, threads=1)


def test_unknown_gguf_architecture_lists_the_supported(tmp_path):
    import gguf

    path = tmp_path / "g.gguf"
    w = gguf.GGUFWriter(path, "qwen2moe")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(KestrelError) as e:
        Engine.from_pretrained(path, threads=1)
    assert str(e.value) == (
        "g.gguf: unsupported GGUF architecture 'qwen2moe' (supported: "
        "llama, qwen2, qwen3, qwen3moe, qwen3vl, qwen3vlmoe)"
    )


def test_cli_names_the_file(small_moe, tmp_path):
    """Through the CLI: one line on stderr naming the file, no traceback, non-zero exit."""
    import subprocess
    import sys

    path = _edited(small_moe, tmp_path / "bad.gguf", "qwen3moe.expert_count", 7)
    p = subprocess.run(
        [sys.executable, "-m", "kestrel_cli.cli", "run", "-m", str(path), "-p", "hi", "-n", "1"],
        capture_output=True,
        text=True,
    )
    assert p.returncode != 0 and "Traceback" not in p.stderr
    assert "bad.gguf: inconsistent MoE metadata" in p.stderr


def test_qwen3vlmoe_gguf_runs_as_qwen3moe(small_moe, tmp_path, monkeypatch):
    """Qwen3-VL-MoE's text decoder (arch qwen3vlmoe, llama.cpp's tensor names of qwen3moe):
    the same logits as the qwen3moe file of the same weights."""
    import gguf

    monkeypatch.setitem(mrc.GGUF_ARCH, "qwen3_moe", "QWEN3VLMOE")
    out = tmp_path / "vlmoe.gguf"
    assert (
        mrc.main([str(out), "--shape", "tiny-qwen3-moe", "--dtype", "f32", "--gguf", "q8_0"]) == 0
    )
    assert gguf.GGUFReader(str(out)).fields["general.architecture"].contents() == "qwen3vlmoe"
    eng = Engine.from_pretrained(out, threads=1)
    assert eng.config.model_type == "qwen3_moe" and eng.config.num_experts == 4
    ids = rand_ids(12, seed=5)
    np.testing.assert_array_equal(
        eng.logits(ids), Engine.from_pretrained(small_moe, threads=1).logits(ids)
    )


def test_missing_metadata_key_is_named(tmp_path):
    import gguf

    path = tmp_path / "m.gguf"
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_uint32("qwen3.attention.head_count", 4)
    w.add_uint32("qwen3.embedding_length", 64)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    w.close()
    with pytest.raises(
        KestrelError,
        match=r"^m.gguf: lacks the GGUF metadata key "
        r"qwen3.block_count$",
    ):
        Engine.from_pretrained(path, threads=1)


def test_experts_repacked_at_load_when_they_fit(moe, monkeypatch):
    """With --repack (the default) every MoE expert takes the decode layout at load, not on
    first use (that made the first tokens of a reply ~3x slower); the results stay those of
    the row-major experts up to summation order (the x16 int8 dot is the prefill GEMM's).
    When the weights would not fit the memory available, the experts are read from the file
    as stored, never copied, and the engine says so in one notice."""
    from kestrel_cli.core import osmem

    d, _, dense = moe
    ids = rand_ids(30, seed=4)
    for act in ("q8", "f32"):
        eng = Engine.load(d / "hf", LoadOptions(quant="q4", threads=1, act=act))
        ref = Engine.load(d / "hf", LoadOptions(quant="q4", threads=1, act=act, repack=False))
        sparse = [i for i in range(len(eng.model.layers)) if i not in dense]
        block = eng.model.layers[sparse[0]].mlp
        assert eng.model.layers[sparse[0]].self_attn.q_proj.fmt == "q4_0x16"
        assert {ex.up_proj.fmt for ex in block.experts} == {"q4_0x16"} and not eng.notices
        assert {ex.up_proj.fmt for ex in ref.model.layers[sparse[0]].mlp.experts} == {"q4_0"}
        np.testing.assert_allclose(eng.logits(ids), ref.logits(ids), atol=1e-4, rtol=0)
        eng.reset()
        ref.reset()
        eng.prefill(ids[:10])
        ref.prefill(ids[:10])
        got = [eng.decode_step(t) for t in ids[10:]]
        want = [ref.decode_step(t) for t in ids[10:]]
        np.testing.assert_allclose(np.concatenate(got), np.concatenate(want), atol=1e-4)
    monkeypatch.setattr(osmem, "available_memory", lambda: 1 << 20)
    low = Engine.load(d / "hf", LoadOptions(quant="q4", threads=1, act="q8"))
    block = low.model.layers[sparse[0]].mlp
    assert {ex.up_proj.fmt for ex in block.experts} == {"q4_0"}
    assert low.model.layers[sparse[0]].self_attn.q_proj.fmt == "q4_0x16"  # dense: as ever
    (note,) = low.notices
    assert "do not fit" in note and "read from the file" in note and "\n" not in note
    ref = Engine.load(d / "hf", LoadOptions(quant="q4", threads=1, act="q8", repack=False))
    np.testing.assert_allclose(low.logits(ids), ref.logits(ids), atol=1e-4, rtol=0)
