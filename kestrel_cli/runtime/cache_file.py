"""Prompt caches on disk: a KV cache's first tokens and their K/V in one file
(`kestrel run --prompt-cache FILE`, `kestrel serve --slot-save-path DIR`).

Layout (little-endian): MAGIC (8 bytes), version u32, header length u32, crc32 of the
header u32, 0 u32; the header (UTF-8 JSON); then the sections, each at a 64-byte aligned
offset the header gives, the file ending where the last one does:

    tokens        int32 (n_tokens,)                 the token ids whose K/V follow
    k, v          uint8 (n_layers, n_blocks, block_bytes)  the cache's blocks as they are
                  in memory (f32 / f16 rows, or int8 values then their scales)
    importance    float32 (n_layers, n_tokens)      the prefill attention mass per token
    bounds,       the sparse probes' per-block key bounds or sketches and their scales,
    bound_scales  the first n_blocks blocks of each (only for a cache that has them)

The header names the format and version, the model (`model`: a hash its caller computes
from the weights' names, formats, shapes and a few bytes of each), the cache spec
(`dtype`, `sparse`: str(SparseSpec) or "none"), the geometry, the token count and the
sections. `load` checks all of it, and the file's size, before it touches the cache: a
foreign, truncated or mismatched file is refused with one line (KestrelError) and the
cache is left as it was. `save` writes FILE.part, fsyncs it and renames it over FILE.
"""

from __future__ import annotations

import json
import struct
import zlib
from pathlib import Path

import numpy as np

from kestrel_cli.core.atomic import atomic_write
from kestrel_cli.core.errors import KestrelError
from kestrel_cli.runtime.kernels import KV_BLOCK

MAGIC = b"KESTRLKV"
VERSION = 1
_PREFIX = struct.Struct("<8sIII I")  # magic, version, header bytes, header crc32, 0
ALIGN = 64
MAX_HEADER = 1 << 20


def _spec_text(spec) -> str:
    return str(spec.sparse) if spec.sparse is not None else "none"


def _probe(cache) -> str:
    if cache.bounds is None:
        return "none"
    return "sketch" if cache.sketch else "bound"


def _cap_axis(cache, name: str) -> int:
    """The axis of the bounds arrays that counts blocks."""
    return 3 if cache.sketch and name == "bounds" else 2


def _blocks_of(cache, name: str, nb: int) -> np.ndarray:
    a = getattr(cache, name)
    sl = [slice(None)] * a.ndim
    sl[_cap_axis(cache, name)] = slice(0, nb)
    return a[tuple(sl)]


def _geometry(cache) -> dict:
    return dict(
        n_layers=cache.n_layers,
        n_kv_heads=cache.n_kv_heads,
        head_dim=cache.head_dim,
        block=KV_BLOCK,
        block_bytes=cache.block_bytes,
        scale_offset=cache.scale_offset,
        probe=_probe(cache),
    )


def save(cache, tokens, model_id: str, path) -> int:
    """Write the first len(tokens) tokens of `cache` (their ids: `tokens`) to `path`,
    atomically. Returns the bytes written."""
    path = Path(path)
    n = len(tokens)
    if n > cache.offset:
        raise KestrelError(f"cannot save {n} tokens: the KV cache holds {cache.offset}")
    nb = -(-n // KV_BLOCK)
    L = cache.n_layers
    arrays: list[tuple[str, object, int]] = []  # name, writer source, bytes
    blocks_bytes = L * nb * cache.block_bytes
    tok = np.asarray(tokens, dtype=np.int32)
    arrays.append(("tokens", tok, tok.nbytes))
    arrays.append(("k", cache.k_blocks, blocks_bytes))
    arrays.append(("v", cache.v_blocks, blocks_bytes))
    imp = np.ascontiguousarray(cache.importance[:, :n])
    arrays.append(("importance", imp, imp.nbytes))
    if cache.bounds is not None:
        for name in ("bounds", "bound_scales"):
            a = np.ascontiguousarray(_blocks_of(cache, name, nb))
            arrays.append((name, a, a.nbytes))
    header = dict(
        format="kestrel prompt cache",
        version=VERSION,
        model=model_id,
        dtype=cache.spec.dtype,
        sparse=_spec_text(cache.spec),
        n_tokens=n,
        n_blocks=nb,
        has_imp=[bool(x) for x in cache._has_imp],
        **_geometry(cache),
    )
    # offsets depend on the header's length: lay out with a fixed-width placeholder
    sections = {name: [0, size] for name, _, size in arrays}
    header["sections"] = sections
    for _ in range(2):
        hdr = json.dumps(header, separators=(",", ":")).encode()
        off = -(-(_PREFIX.size + len(hdr) + 32) // ALIGN) * ALIGN  # 32: room to grow
        for name, _, size in arrays:
            sections[name] = [off, size]
            off = -(-(off + size) // ALIGN) * ALIGN
        header["file_bytes"] = sections[arrays[-1][0]][0] + arrays[-1][2]
    hdr = json.dumps(header, separators=(",", ":")).encode()
    assert _PREFIX.size + len(hdr) <= sections["tokens"][0]
    with atomic_write(path) as f:
        f.write(_PREFIX.pack(MAGIC, VERSION, len(hdr), zlib.crc32(hdr), 0))
        f.write(hdr)
        for name, src, _ in arrays:
            f.write(b"\0" * (sections[name][0] - f.tell()))
            if name in ("k", "v"):
                for layer in range(L):
                    for b in src[layer][:nb]:
                        f.write(memoryview(b).cast("B"))
            elif src.size:  # (a memoryview of an empty array cannot be cast)
                f.write(memoryview(src).cast("B"))
        size = f.tell()
    return size


class CacheFile:
    """A prompt cache file, read and checked against a cache (`open`): its header and its
    sections mapped (np.memmap), nothing copied yet."""

    def __init__(self, path, header: dict, mm: np.ndarray):
        self.path, self.header, self._mm = Path(path), header, mm

    @property
    def n_tokens(self) -> int:
        return int(self.header["n_tokens"])

    @property
    def nbytes(self) -> int:
        return int(self.header["file_bytes"])

    def section(self, name: str, dtype, shape) -> np.ndarray:
        off, size = self.header["sections"][name]
        return self._mm[off : off + size].view(dtype).reshape(shape)

    def tokens(self) -> list[int]:
        return self.section("tokens", np.int32, (self.n_tokens,)).tolist()


def _refuse(path, why: str) -> KestrelError:
    return KestrelError(f"prompt cache {path}: {why}")


def open_file(path, cache, model_id: str) -> CacheFile:
    """Read and check `path` for `cache` and the model `model_id`; KestrelError (one line)
    for a file that is not ours, truncated, or made by another model or cache spec."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            prefix = f.read(_PREFIX.size)
            if len(prefix) < _PREFIX.size or prefix[:8] != MAGIC:
                raise _refuse(path, "not a kestrel prompt cache file")
            magic, version, hlen, crc, _ = _PREFIX.unpack(prefix)
            if version != VERSION:
                raise _refuse(path, f"format version {version}, this kestrel reads {VERSION}")
            if hlen > MAX_HEADER or _PREFIX.size + hlen > size:
                raise _refuse(path, "truncated (its header is cut short)")
            hdr = f.read(hlen)
    except OSError as e:
        raise _refuse(path, e.strerror or str(e)) from None
    if len(hdr) != hlen or zlib.crc32(hdr) != crc:
        raise _refuse(path, "damaged header (checksum mismatch)")
    try:
        h = json.loads(hdr)
        n, nb, secs = int(h["n_tokens"]), int(h["n_blocks"]), h["sections"]
        total = int(h["file_bytes"])
    except (ValueError, KeyError, TypeError):
        raise _refuse(path, "damaged header") from None
    if size < total:
        raise _refuse(path, f"truncated ({size} of {total} bytes)")
    if h.get("model") != model_id:
        raise _refuse(path, "made by another model (its weights or settings differ)")
    want = _spec_text(cache.spec)
    if h.get("dtype") != cache.spec.dtype:
        raise _refuse(path, f"holds a {h.get('dtype')} KV cache, this one is {cache.spec.dtype}")
    if h.get("sparse") != want:
        raise _refuse(path, f"made with sparse options {h.get('sparse')}, these are {want}")
    geo = _geometry(cache)
    bad = [k for k, v in geo.items() if h.get(k) != v]
    if bad:
        raise _refuse(path, f"another cache layout ({', '.join(bad)} differ)")
    if n > cache.max_tokens:
        raise _refuse(path, f"holds {n} tokens, more than the context size {cache.max_tokens}")
    if nb != -(-n // KV_BLOCK) or len(h.get("has_imp", ())) != cache.n_layers:
        raise _refuse(path, "damaged header")
    L, bb = cache.n_layers, cache.block_bytes
    need = {
        "tokens": 4 * n,
        "k": L * nb * bb,
        "v": L * nb * bb,
        "importance": 4 * L * n,
    }
    if cache.bounds is not None:
        for name in ("bounds", "bound_scales"):
            need[name] = _blocks_of(cache, name, nb).nbytes
    try:
        ok = set(secs) == set(need) and all(
            int(secs[k][1]) == v and 0 <= int(secs[k][0]) and int(secs[k][0]) + v <= total
            for k, v in need.items()
        )
    except (TypeError, ValueError, IndexError):
        ok = False
    if not ok:
        raise _refuse(path, "damaged header (its sections do not fit the cache)")
    mm = np.memmap(path, dtype=np.uint8, mode="r") if size else np.zeros(0, np.uint8)
    cf = CacheFile(path, h, mm)
    toks = cf.section("tokens", np.int32, (n,))
    if n and (toks.min() < 0):
        raise _refuse(path, "damaged (negative token ids)")
    return cf


def load_into(cf: CacheFile, cache) -> list[int]:
    """Replace `cache`'s contents with the checked file's (`open_file`); its token ids."""
    h, n = cf.header, cf.n_tokens
    nb, L, bb = int(h["n_blocks"]), cache.n_layers, cache.block_bytes
    tokens = cf.tokens()
    cache.reset()
    cache.reserve(n)
    for name, blocks in (("k", cache.k_blocks), ("v", cache.v_blocks)):
        src = cf.section(name, np.uint8, (L, nb, bb))
        for layer in range(L):
            for b in range(nb):
                dst = blocks[layer][b]
                np.copyto(dst.view(np.uint8).reshape(-1)[:bb], src[layer, b])
    cache.importance[:, :n] = cf.section("importance", np.float32, (L, n))
    if cache.bounds is not None:
        for name in ("bounds", "bound_scales"):
            view = _blocks_of(cache, name, nb)
            view[...] = cf.section(name, view.dtype, view.shape)
    cache.offset = n
    cache._imp_end = n
    cache._has_imp[:] = np.asarray(h["has_imp"], dtype=bool)
    cache.trim(n)  # the derived state: importance order, decode tables, last block's bound
    return tokens
