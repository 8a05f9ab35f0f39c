"""Small valid files for the hostile-input tests and the fuzzers to break: a GGUF model, a
safetensors file, images; and where each header field of a GGUF lies (to patch it)."""

from __future__ import annotations

import io
import json
import struct
import zlib
from pathlib import Path

import numpy as np


def byte_level_tokens() -> list[str]:
    """GPT-2's byte-to-unicode alphabet: the 256 one-character tokens of a byte-level BPE."""
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def write_gguf(
    path: Path,
    hidden: int = 32,
    ff: int = 32,
    heads: int = 2,
    kv_heads: int | None = None,
    q8: bool = True,
    poison: dict[str, float] | None = None,
) -> Path:
    """A tiny llama GGUF (one layer, a 261-token byte-level vocabulary, f32/f16/q8_0 tensors)
    that loads and runs. `q8=False`: attn_q in f32 too (hidden need not be whole blocks of
    32: hidden=4 gives a file of a few KB, small enough for the fuzz corpus). `poison`:
    tensor name -> a value (NaN, inf) written into its first element, as a corrupt file
    would hold."""
    import gguf

    rng = np.random.default_rng(0)
    poison = dict(poison or {})
    tokens = byte_level_tokens() + ["Ġt", "he", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ff)
    w.add_head_count(heads)
    w.add_head_count_kv(heads if kv_heads is None else kv_heads)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(10000.0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 258 + [3, 3, 3])
    w.add_token_merges(["Ġ t", "h e"])
    w.add_eos_token_id(len(tokens) - 2)
    w.add_add_bos_token(False)
    w.add_chat_template(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
        "<|im_end|>\n{% endfor %}<|im_start|>assistant\n"
    )

    def mat(d, n, dtype=np.float16):
        return (rng.standard_normal((d, n)) / n**0.5).astype(dtype)

    def add(name, a):
        if name in poison:
            a = a.copy()
            a.flat[0] = poison.pop(name)
        w.add_tensor(name, a)

    V = len(tokens)
    add("token_embd.weight", mat(V, hidden))
    add("blk.0.attn_norm.weight", np.ones(hidden, np.float32))
    if q8:
        q = gguf.quants.quantize(mat(hidden, hidden, np.float32), gguf.GGMLQuantizationType.Q8_0)
        w.add_tensor(
            "blk.0.attn_q.weight", q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0
        )
    else:
        add("blk.0.attn_q.weight", mat(hidden, hidden, np.float32))
    add("blk.0.attn_k.weight", mat((kv_heads or heads) * (hidden // heads), hidden, np.float32))
    add("blk.0.attn_v.weight", mat((kv_heads or heads) * (hidden // heads), hidden))
    add("blk.0.attn_output.weight", mat(hidden, hidden))
    add("blk.0.ffn_norm.weight", np.ones(hidden, np.float32))
    add("blk.0.ffn_gate.weight", mat(ff, hidden))
    add("blk.0.ffn_up.weight", mat(ff, hidden))
    add("blk.0.ffn_down.weight", mat(hidden, ff))
    add("output_norm.weight", np.ones(hidden, np.float32))
    assert not poison, f"no such tensor: {poison}"
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_fields(path: Path) -> dict[str, tuple[int, int]]:
    """name -> (offset, size) of each number in a GGUF header that a hostile file could set:
    counts, key/string/array lengths, value and item types, scalar values, tensor n_dims,
    dims, types and offsets. Names: "GGUF.tensor_count", "<key>#<i>" for the i-th part of a
    metadata field, "tensor:<name>#<i>" for a tensor info's parts."""
    import gguf

    r = gguf.GGUFReader(str(path))
    base = r.data.ctypes.data
    out = {}

    def add(prefix, parts):
        for i, p in enumerate(parts):
            if p.dtype.kind in "uif" and p.size == 1:  # a number, not string bytes
                out[f"{prefix}#{i}"] = (p.ctypes.data - base, p.dtype.itemsize)
            elif p.dtype.kind in "uif" and p.ndim == 1 and i == 3 and prefix.startswith("tensor:"):
                for j in range(p.size):  # the dims of a tensor
                    out[f"{prefix}#dim{j}"] = (p.ctypes.data - base + 8 * j, 8)

    for key, f in r.fields.items():
        add(key, f.parts[:64])  # a long array: its header and first items
    for t in r.tensors:
        add(f"tensor:{t.name}", t.field.parts)
    return out


def patch(data: bytes, offset: int, size: int, value: int) -> bytes:
    """`data` with the little-endian integer of `size` bytes at `offset` set to value."""
    fmt = {1: "<B", 2: "<H", 4: "<I", 8: "<Q"}[size]
    return data[:offset] + struct.pack(fmt, value % (1 << 8 * size)) + data[offset + size :]


def write_safetensors(
    path: Path, tensors: dict[str, np.ndarray] | None = None, header_extra: dict | None = None
) -> Path:
    """A safetensors file of `tensors` (default: three small float32/float16 ones)."""
    if tensors is None:
        rng = np.random.default_rng(0)
        tensors = {
            "a.weight": rng.standard_normal((4, 32)).astype(np.float32),
            "b.weight": rng.standard_normal((8, 32)).astype(np.float16),
            "norm.weight": np.ones(32, np.float32),
        }
    header, blobs, off = dict(header_extra or {}), [], 0
    for name, a in tensors.items():
        dt = {np.float32: "F32", np.float16: "F16"}[a.dtype.type]
        header[name] = {"dtype": dt, "shape": list(a.shape), "data_offsets": [off, off + a.nbytes]}
        blobs.append(a.tobytes())
        off += a.nbytes
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + b"".join(blobs))
    return path


def split_safetensors(data: bytes) -> tuple[dict, bytes]:
    (n,) = struct.unpack("<Q", data[:8])
    return json.loads(data[8 : 8 + n]), data[8 + n :]


def join_safetensors(header: dict, body: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def image_bytes(fmt: str, size=(16, 12), mode="RGB") -> bytes:
    from PIL import Image

    rng = np.random.default_rng(1)
    arr = rng.integers(0, 256, (size[1], size[0], len(mode)), dtype=np.uint8)
    img = Image.fromarray(arr[..., 0] if mode == "L" else arr, mode)
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def png_header_only(width: int, height: int) -> bytes:
    """A PNG whose IHDR claims width x height (CRC right) with one tiny IDAT: a decompression
    bomb's header without its bulk."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return (
            struct.pack(">I", len(body))
            + kind
            + body
            + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
        )

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )
