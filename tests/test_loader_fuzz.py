"""Fuzzing the readers of untrusted files (issue 16): GGUF, safetensors, the shard index,
config.json and images, mutated thousands of times per run (hypothesis, derandomized: the
same cases on every run). Every case ends in success or one clean KestrelError naming the
file; never another exception, a hang (SIGVTALRM) or an allocation over a budget
(tracemalloc's peak; Pillow's and the tokenizer's own C allocations are held to a bound on
the process's peak RSS instead). The cases that once failed live in tests/fuzz_corpus/ and
are replayed by test_corpus.

FUZZ_SCALE=10 (environment) runs ten times the examples, for a longer hunt by hand.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import resource
import shutil
import signal
import struct
import tracemalloc
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostile_seeds import (
    gguf_fields,
    image_bytes,
    join_safetensors,
    split_safetensors,
    write_gguf,
    write_safetensors,
)
from kestrel_cli import Engine, KestrelError

CORPUS = Path(__file__).parent / "fuzz_corpus"
SCALE = float(os.environ.get("FUZZ_SCALE", "1"))
BUDGET = 256 << 20  # bytes one case may allocate (peak, Python and NumPy)
RSS_GROWTH = 1 << 30  # what the whole module may add to the process's peak RSS
CASE_SECONDS = 10  # a case that takes more CPU seconds is a hang


def fuzz(n: int):
    return settings(
        max_examples=max(1, int(n * SCALE)),
        derandomize=True,
        database=None,
        deadline=None,
        print_blob=True,
        suppress_health_check=list(HealthCheck),
    )


class Hang(Exception):
    pass


@pytest.fixture(scope="module", autouse=True)
def rss_bound():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
    yield
    grew = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
    assert grew < RSS_GROWTH, f"the fuzzed readers grew the peak RSS by {grew >> 20} MiB"


@contextlib.contextmanager
def bounded():
    """One case: SIGVTALRM after CASE_SECONDS of CPU, and its allocation peak checked (traced for the
    case only: hypothesis's own work runs untraced, at full speed)."""

    def ring(*_):
        raise Hang(f"a case ran over {CASE_SECONDS} s")

    old = signal.signal(signal.SIGVTALRM, ring)  # CPU time: a starved process is no hang
    signal.setitimer(signal.ITIMER_VIRTUAL, CASE_SECONDS)
    tracemalloc.start()
    try:
        yield
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)
        signal.signal(signal.SIGVTALRM, old)
    assert peak < BUDGET, f"a case allocated {peak >> 20} MiB"


def clean(fn, name: str | None = None):
    """fn() succeeds or raises one KestrelError: one line, naming `name` when given."""
    with bounded():
        try:
            return fn()
        except KestrelError as e:
            msg = str(e)
            assert msg and "\n" not in msg and len(msg) < 2000, msg
            assert "Traceback" not in msg, msg
            if name is not None:
                assert name in msg, msg
            return None


# ------------------------------------------------------------------ byte mutations

INTERESTING = [
    0,
    1,
    2,
    3,
    4,
    7,
    8,
    9,
    15,
    16,
    31,
    32,
    33,
    63,
    64,
    127,
    128,
    255,
    256,
    1023,
    1024,
    4095,
    4096,
    65535,
    65536,
    (1 << 31) - 1,
    1 << 31,
    (1 << 32) - 1,
    1 << 32,
    1 << 40,
    1 << 53,
    (1 << 62),
    (1 << 63) - 1,
    1 << 63,
    (1 << 64) - 1,
]


def mutate(
    rng: random.Random,
    data: bytes,
    hot: list[tuple[int, int]] = (),
    head: int | None = None,
    big_endian: bool = False,
) -> bytes:
    """1-4 mutations of `data`: a known header number set to an interesting value (`hot`:
    (offset, size) pairs), a byte or a run of bytes overwritten, an integer written at any
    offset, bytes inserted or deleted, the file cut. Positions favour the first `head` bytes.
    The choices come from `rng`, seeded by hypothesis (one draw per case keeps it fast)."""
    buf = bytearray(data)
    head = min(head or len(buf), len(buf))
    kinds = ["byte", "int", "cut", "insert", "delete", "run"] + (["field"] * 4 if hot else [])
    for _ in range(rng.randint(1, 4)):
        if not buf:
            break
        kind = rng.choice(kinds)
        hi = head if rng.randint(0, 9) else len(buf)
        pos = rng.randint(0, max(0, min(hi, len(buf)) - 1))
        if kind == "field":
            off, size = rng.choice(hot)
            v = rng.choice(INTERESTING) if rng.randint(0, 3) else rng.getrandbits(8 * size)
            if off + size <= len(buf):
                buf[off : off + size] = (v % (1 << 8 * size)).to_bytes(size, "little")
        elif kind == "byte":
            buf[pos] = rng.randint(0, 255)
        elif kind == "int":
            size = rng.choice([1, 2, 4, 8])
            v = rng.choice(INTERESTING) % (1 << 8 * size)
            buf[pos : pos + size] = v.to_bytes(size, "big" if big_endian else "little")
        elif kind == "cut":
            del buf[pos:]
        elif kind == "insert":
            buf[pos:pos] = rng.randbytes(rng.randint(1, 16))
        elif kind == "delete":
            del buf[pos : pos + rng.randint(1, 64)]
        else:
            n = rng.randint(1, 32)
            buf[pos : pos + n] = bytes([rng.randint(0, 255)]) * n
    return bytes(buf)


SEEDS = st.integers(0, (1 << 32) - 1).map(random.Random)


# ------------------------------------------------------------------ GGUF


@pytest.fixture(scope="module")
def gguf_seed(tmp_path_factory):
    p = write_gguf(tmp_path_factory.mktemp("seed") / "seed.gguf")
    import gguf

    head = gguf.GGUFReader(str(p)).data_offset
    return p.read_bytes(), list(gguf_fields(p).values()), head


def gguf_target(path: Path):
    """The whole road a GGUF takes: header check, metadata, tokenizer, model, two tokens'
    logits, then three tokens generated greedily (NaN/Inf weights and absurd head counts
    must end in one KestrelError: ModelError when sampling, never a token picked from NaN)."""
    eng = Engine.from_pretrained(path, threads=1)
    out = eng.logits([0, 1])
    assert out.shape == (2, eng.config.vocab_size)
    eng.tokenizer.decode(eng.tokenizer.encode("hi there"))
    list(eng.generate([0, 1], max_tokens=3, temperature=0.0))
    # it sampled from the same prompt's last row: that row must have been finite
    assert np.isfinite(out[-1]).all(), "a token was picked from non-finite logits"


@given(rng=SEEDS)
@fuzz(1200)
def test_gguf(gguf_seed, tmp_path_factory, rng):
    seed, hot, head = gguf_seed
    path = tmp_path_factory.getbasetemp() / "fuzz.gguf"
    path.write_bytes(mutate(rng, seed, hot, head))
    clean(lambda: gguf_target(path), "fuzz.gguf")


# ------------------------------------------------------------------ safetensors


@pytest.fixture(scope="module")
def st_seed(tmp_path_factory):
    p = write_safetensors(
        tmp_path_factory.mktemp("seed") / "seed.safetensors",
        header_extra={"__metadata__": {"format": "pt"}},
    )
    return p.read_bytes()


def safetensors_target(path: Path):
    from kestrel_cli.models.loader import TensorStore, _open_safetensors

    store = TensorStore()
    _open_safetensors(path, store)
    for name, (fmt, raw, shape, _) in list(store.entries.items()):
        if fmt.startswith("unsupported:"):
            continue
        if len(shape) == 2:
            w = store.matrix(name, shape)
            assert w.dequantize().shape == shape
        elif len(shape) == 1:
            assert store.vector(name, shape).shape == shape


JSON_LEAF = (
    st.none()
    | st.booleans()
    | st.sampled_from(INTERESTING)
    | st.integers(-(1 << 70), 1 << 70)
    | st.floats(allow_nan=True)
    | st.text(max_size=8)
    | st.sampled_from(["F32", "F16", "BF16", "I8", "F64", "U8"])
)
JSON_VALUE = st.recursive(
    JSON_LEAF,
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=4,
)


@given(data=st.data())
@fuzz(1500)
def test_safetensors(st_seed, tmp_path_factory, data):
    path = tmp_path_factory.getbasetemp() / "fuzz.safetensors"
    header, body = split_safetensors(st_seed)
    if data.draw(st.booleans()):  # a field of the JSON header replaced
        names = [k for k in header if k != "__metadata__"]
        for _ in range(data.draw(st.integers(1, 3))):
            name = data.draw(st.sampled_from(names + ["__metadata__", "new"]))
            key = data.draw(st.sampled_from(["dtype", "shape", "data_offsets", None]))
            shape_or_offsets = st.lists(
                st.sampled_from(INTERESTING) | st.integers(-64, 256), max_size=3
            )
            value = data.draw(JSON_VALUE | shape_or_offsets)
            if key is None or not isinstance(header.get(name), dict):
                header[name] = value
            else:
                header[name] = {**header[name], key: value}
        raw = join_safetensors(header, body)
    else:
        raw = st_seed
    if data.draw(st.booleans()):  # and/or bytes, mostly in the header
        (n,) = struct.unpack("<Q", raw[:8])
        raw = mutate(data.draw(SEEDS), raw, [(0, 8)], 8 + n)
    path.write_bytes(raw)
    clean(lambda: safetensors_target(path), "fuzz.safetensors")


# ------------------------------------------------------------------ the shard index

SHARD_NAMES = (
    st.sampled_from(
        [
            "model.safetensors",
            "other.safetensors",
            "../model.safetensors",
            "/etc/passwd",
            "",
            ".",
            "..",
            "sub/model.safetensors",
            "a\\b",
            "x\0y",
            "link.safetensors",
            "out.safetensors",
            "MODEL.safetensors",
            " model.safetensors",
        ]
    )
    | st.text(max_size=12)
    | JSON_VALUE
)


@pytest.fixture(scope="module")
def index_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("index")
    d = root / "ckpt"
    d.mkdir()
    write_safetensors(d / "model.safetensors")
    write_safetensors(root / "out.safetensors")
    (d / "link.safetensors").symlink_to(root / "out.safetensors")
    return d


@given(data=st.data())
@fuzz(800)
def test_index(index_dir, data):
    from kestrel_cli.models.loader import shard_files

    if data.draw(st.integers(0, 4)):
        wm = data.draw(st.dictionaries(st.text(max_size=8), SHARD_NAMES, max_size=4))
        index = {"metadata": data.draw(JSON_VALUE), "weight_map": wm}
        if not data.draw(st.integers(0, 9)):
            index = data.draw(JSON_VALUE)
        raw = json.dumps(index).encode()
    else:
        raw = mutate(
            data.draw(SEEDS), json.dumps({"weight_map": {"a": "model.safetensors"}}).encode()
        )
    (index_dir / "model.safetensors.index.json").write_bytes(raw)
    files = clean(lambda: shard_files(index_dir), "model.safetensors.index.json")
    for f in files or []:
        assert f.parent == index_dir and f.resolve().parent == index_dir.resolve(), f
        assert f.is_file()


# ------------------------------------------------------------------ config.json

BASE_CONFIG = {
    "model_type": "qwen3",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 96,
    "vocab_size": 320,
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 512,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
CONFIG_KEYS = sorted(
    set(BASE_CONFIG)
    | {
        "rope_scaling",
        "rope_parameters",
        "partial_rotary_factor",
        "num_experts",
        "num_local_experts",
        "num_experts_per_tok",
        "moe_intermediate_size",
        "decoder_sparse_step",
        "mlp_only_layers",
        "layer_types",
        "sliding_window",
        "use_sliding_window",
        "max_window_layers",
        "eos_token_id",
        "bos_token_id",
        "hidden_act",
        "attention_bias",
        "mlp_bias",
        "text_config",
        "vision_config",
        "image_token_id",
    }
)
ROPE = st.fixed_dictionaries(
    {},
    optional={
        "rope_type": st.sampled_from(["default", "linear", "llama3", "yarn", None]) | JSON_LEAF,
        "type": JSON_LEAF,
        "rope_theta": JSON_LEAF,
        "factor": JSON_LEAF,
        "low_freq_factor": JSON_LEAF,
        "high_freq_factor": JSON_LEAF,
        "original_max_position_embeddings": JSON_LEAF,
        "partial_rotary_factor": JSON_LEAF,
    },
)
NUMBERS = (
    st.sampled_from(INTERESTING)
    | st.integers(-5, 5)
    | st.floats(allow_nan=True)
    | st.sampled_from([-1, -(1 << 63), 1e-12, 1e308, 0.5, 64.0])
)


def config_target(raw):
    from kestrel_cli.models.loader import config_of

    cfg = config_of(raw, Path("config.json"))
    inv, scale = cfg.rope_inv_freq()
    assert inv.shape == (cfg.head_dim // 2,) and np.isfinite(inv).all() and math.isfinite(scale)
    assert cfg.num_attention_heads % cfg.num_key_value_heads == 0 and cfg.head_dim >= 2
    for f in ("hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"):
        assert type(getattr(cfg, f)) is int and getattr(cfg, f) >= 1, f
    assert cfg.rms_norm_eps > 0 and math.isfinite(cfg.rms_norm_eps)


@given(data=st.data())
@fuzz(2000)
def test_config(data):
    raw = dict(BASE_CONFIG)
    if data.draw(st.booleans()):
        raw["model_type"] = data.draw(
            st.sampled_from(["qwen3_moe", "llama", "qwen2", "mistral", "qwen3_vl"])
        )
    for _ in range(data.draw(st.integers(1, 4))):
        key = data.draw(st.sampled_from(CONFIG_KEYS))
        if key in ("rope_scaling", "rope_parameters"):
            raw[key] = data.draw(ROPE | JSON_VALUE)
        elif key == "text_config":
            raw[key] = data.draw(st.just(dict(BASE_CONFIG)) | JSON_VALUE)
        else:
            raw[key] = data.draw(NUMBERS | JSON_VALUE)
    clean(lambda: config_target(raw), "config.json")


@given(rng=SEEDS)
@fuzz(800)
def test_config_file_bytes(tmp_path_factory, rng):
    from kestrel_cli.models.loader import read_json_object

    path = tmp_path_factory.getbasetemp() / "config.json"
    path.write_bytes(mutate(rng, json.dumps(BASE_CONFIG).encode()))
    clean(lambda: config_target(read_json_object(path)), "config.json")


# ------------------------------------------------------------------ images

IMAGE_SEEDS = [
    ("PNG", "RGB"),
    ("PNG", "RGBA"),
    ("JPEG", "RGB"),
    ("GIF", "L"),
    ("BMP", "RGB"),
    ("TIFF", "RGB"),
    ("WEBP", "RGB"),
    ("ICO", "RGBA"),
]


@pytest.fixture(scope="module")
def image_seeds():
    return [image_bytes(fmt, (24, 16), mode) for fmt, mode in IMAGE_SEEDS]


def image_target(data: bytes):
    from kestrel_cli.models.images import ImageConfig, load_image, preprocess

    img = load_image(data)
    cfg = ImageConfig(min_pixels=256, max_pixels=4096)
    out = preprocess(img, cfg)
    assert np.isfinite(out.patches).all() and out.n_tokens >= 1


@given(rng=SEEDS)
@fuzz(2000)
@pytest.mark.filterwarnings("ignore::UserWarning")  # Pillow's notes on corrupt TIFF tags
def test_images(image_seeds, rng):
    seed = rng.choice(image_seeds)
    raw = mutate(rng, seed, head=64, big_endian=rng.random() < 0.5)
    clean(lambda: image_target(raw))


# ------------------------------------------------------------------ the corpus


def corpus_cases():
    # one folder per reader (files at the top are other suites': the server's requests)
    return sorted(p for p in CORPUS.rglob("*") if p.is_file() and p.parent != CORPUS)


@pytest.mark.parametrize("case", corpus_cases(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_corpus(case, tmp_path, index_dir):
    """Each file that once broke a reader now gets a clean answer from it."""
    kind = case.parent.name
    if kind == "gguf":
        clean(lambda: gguf_target(case), case.name)
    elif kind == "safetensors":
        clean(lambda: safetensors_target(case), case.name)
    elif kind == "index":
        shutil.copy(case, index_dir / "model.safetensors.index.json")
        from kestrel_cli.models.loader import shard_files

        clean(lambda: shard_files(index_dir), "model.safetensors.index.json")
    elif kind == "config":
        from kestrel_cli.models.loader import read_json_object

        p = tmp_path / "config.json"
        shutil.copy(case, p)
        clean(lambda: config_target(read_json_object(p)), "config.json")
    elif kind == "images":
        clean(lambda: image_target(case.read_bytes()))
    else:
        raise AssertionError(f"unknown corpus kind {kind}")


def test_corpus_is_small_and_present():
    cases = corpus_cases()
    kinds = {p.parent.name for p in cases}
    assert {"gguf", "safetensors", "index", "config", "images"} <= kinds, kinds
    assert all(p.stat().st_size <= 8192 for p in cases)
