"""A GGUF file's header checked before the gguf package parses it: every count, length,
type, alignment and tensor extent the file claims is held against the file's size and
against fixed budgets, and a bad one is one KestrelError naming the file and the field.

The layout (little- or big-endian, as the version field tells):
  "GGUF", version u32 (2 or 3), tensor_count u64, kv_count u64,
  kv_count x (key string, value type u32, value),
  tensor_count x (name string, n_dims u32, n_dims x u64 dims, ggml type u32, offset u64),
  padding to general.alignment (default 32), then the tensor data.
  A string is a u64 length and its bytes; an array is an item type u32, a u64 count, items.
The gguf package trusts these numbers (an absurd count made it loop for hours or fail with
numpy's "index 0 is out of bounds"), so the loader runs `check_gguf` first.
"""

from __future__ import annotations

import struct
from pathlib import Path

from kestrel_cli.core.errors import KestrelError

# value type -> size in bytes (8 string, 9 array: variable)
_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_TYPE_NAMES = {
    0: "uint8",
    1: "int8",
    2: "uint16",
    3: "int16",
    4: "uint32",
    5: "int32",
    6: "float32",
    7: "bool",
    8: "string",
    9: "array",
    10: "uint64",
    11: "int64",
    12: "float64",
}
# budgets: far above any published model, far below what would exhaust memory (the gguf
# package holds one Python object per array element and per tensor)
MAX_KV = 1 << 16
MAX_TENSORS = 1 << 16
MAX_ARRAY_ITEMS = 1 << 22  # over all metadata arrays (a 262K vocabulary uses ~1M)
MAX_KEY = 1 << 16
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ALIGNMENT = 1 << 16


def printable(name: str, limit: int = 80) -> str:
    """A key or tensor name as a message may show it: itself, or its repr when it holds a
    newline or another control character (an error is one line); cut to `limit` characters."""
    s = name if name.isprintable() else repr(name)
    return s if len(s) <= limit else s[: limit - 3] + "..."


def _quant_sizes() -> dict[int, tuple[int, int]]:
    """ggml type id -> (elements per block, bytes per block), from the gguf package."""
    from gguf.constants import GGML_QUANT_SIZES

    return {int(t): v for t, v in GGML_QUANT_SIZES.items()}


class _Cursor:
    """Reads the header of one file, each read checked against the file's end."""

    def __init__(self, path: Path, buf, order: str):
        self.path, self.buf, self.order, self.pos = path, buf, order, 0
        self.size = len(buf)

    def fail(self, where: str, why: str):
        raise KestrelError(f"{self.path.name}: not a valid GGUF file: {where}: {why}")

    def need(self, n: int, where: str) -> None:
        if n > self.size - self.pos:
            self.fail(
                where,
                f"needs {n} bytes at offset {self.pos}, the file has "
                f"{self.size - self.pos} left (truncated or corrupt)",
            )

    def unpack(self, fmt: str, where: str):
        n = struct.calcsize(fmt)
        self.need(n, where)
        v = struct.unpack_from(self.order + fmt, self.buf, self.pos)
        self.pos += n
        return v if len(v) > 1 else v[0]

    def string(self, where: str, limit: int | None = None) -> bytes:
        n = self.unpack("Q", where + " (string length)")
        if limit is not None and n > limit:
            self.fail(where, f"a string of {n} bytes (at most {limit})")
        self.need(n, where)
        s = self.buf[self.pos : self.pos + n].tobytes()
        self.pos += n
        return s

    def skip_strings(self, count: int, where: str) -> None:
        """`count` strings, their lengths checked one by one (a vocabulary: ~150K of them)."""
        buf, pos, end, order = self.buf, self.pos, self.size, self.order
        unpack = struct.Struct(order + "Q").unpack_from
        for i in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.fail(f"{where}[{i}]", "the array runs past the end of the file")
            n = unpack(buf, pos)[0]
            pos += 8 + n
            if pos > end:
                self.pos = pos - 8 - n
                self.fail(f"{where}[{i}]", f"a string of {n} bytes runs past the end of the file")
        self.pos = pos


def check_gguf(path) -> None:
    """Raise one KestrelError naming `path` and the field if its header is not sound; the
    tensors' types, extents, alignment and overlaps included. Returns None when it is."""
    import numpy as np

    path = Path(path)
    try:
        size = path.stat().st_size
        if size < 24:
            raise KestrelError(f"{path.name}: not a valid GGUF file (only {size} bytes)")
        buf = np.memmap(path, dtype=np.uint8, mode="r")
    except OSError as e:
        raise KestrelError(f"{path.name}: cannot read ({e.strerror or e})") from None
    _walk(path, buf)


def _walk(path: Path, buf) -> None:
    if buf[:4].tobytes() != b"GGUF":
        raise KestrelError(f"{path.name}: not a GGUF file (no GGUF magic)")
    (v,) = struct.unpack_from("<I", memoryview(buf), 4)
    order = "<" if v & 0xFFFF else ">"  # the gguf package's test for a swapped file
    c = _Cursor(path, memoryview(buf), order)
    c.pos = 4
    version = c.unpack("I", "version")
    if version not in (2, 3):
        c.fail("version", f"{version} (supported: 2, 3)")
    n_tensors = c.unpack("Q", "tensor_count")
    n_kv = c.unpack("Q", "kv_count")
    if n_kv > MAX_KV or n_kv * 13 > c.size - c.pos:  # a kv takes >= 13 bytes
        c.fail("kv_count", f"{n_kv} key-value pairs cannot fit in the file (or exceed {MAX_KV})")
    if n_tensors > MAX_TENSORS or n_tensors * 24 > c.size - c.pos:
        c.fail(
            "tensor_count", f"{n_tensors} tensors cannot fit in the file (or exceed {MAX_TENSORS})"
        )
    keys: set[str] = set()
    items = 0
    alignment = 32
    for i in range(n_kv):
        raw = c.string(f"metadata key #{i}", MAX_KEY)
        try:
            key = printable(raw.decode("utf-8"))
        except UnicodeDecodeError:
            c.fail(f"metadata key #{i}", "not UTF-8")
        if key in keys:
            c.fail(key, "the key appears twice")
        keys.add(key)
        vtype = c.unpack("I", f"{key} (value type)")
        if vtype == _ARRAY:
            itype = c.unpack("I", f"{key} (array item type)")
            count = c.unpack("Q", f"{key} (array length)")
            items += count
            if items > MAX_ARRAY_ITEMS:
                c.fail(
                    key,
                    f"an array of {count} items: the metadata arrays exceed "
                    f"{MAX_ARRAY_ITEMS} items in all",
                )
            if itype == _STRING:
                if count * 8 > c.size - c.pos:
                    c.fail(key, f"an array of {count} strings cannot fit in the file")
                c.skip_strings(count, key)
            elif itype in _SCALAR:
                c.need(count * _SCALAR[itype], f"{key} (array of {count} {_TYPE_NAMES[itype]})")
                c.pos += count * _SCALAR[itype]
            elif itype == _ARRAY:
                c.fail(key, "arrays of arrays are not supported")
            else:
                c.fail(key, f"unknown array item type {itype}")
        elif vtype == _STRING:
            c.string(key)
        elif vtype in _SCALAR:
            if key == "general.alignment":
                if vtype != 4:
                    c.fail(key, f"type {_TYPE_NAMES[vtype]}, expected uint32")
                alignment = c.unpack("I", key)
                if alignment == 0 or alignment & (alignment - 1) or alignment > MAX_ALIGNMENT:
                    c.fail(key, f"{alignment} is not a power of two in 1..{MAX_ALIGNMENT}")
            else:
                c.need(_SCALAR[vtype], key)
                c.pos += _SCALAR[vtype]
        else:
            c.fail(key, f"unknown value type {vtype}")
    sizes = _quant_sizes()
    tensors = []
    names: set[str] = set()
    for i in range(n_tensors):
        raw = c.string(f"tensor #{i} name", MAX_KEY)
        try:
            name = printable(raw.decode("utf-8"))
        except UnicodeDecodeError:
            c.fail(f"tensor #{i} name", "not UTF-8")
        if name in names:
            c.fail(f"tensor {name}", "the name appears twice")
        names.add(name)
        n_dims = c.unpack("I", f"tensor {name} (n_dims)")
        if not 1 <= n_dims <= MAX_DIMS:
            c.fail(f"tensor {name}", f"n_dims={n_dims} (1..{MAX_DIMS})")
        dims = c.unpack(f"{n_dims}Q", f"tensor {name} (dims)")
        dims = (dims,) if n_dims == 1 else dims
        ggml_type = c.unpack("I", f"tensor {name} (type)")
        offset = c.unpack("Q", f"tensor {name} (offset)")
        if ggml_type not in sizes:
            c.fail(f"tensor {name}", f"unknown ggml type {ggml_type}")
        block, type_size = sizes[ggml_type]
        if any(d < 1 or d > 1 << 40 for d in dims):
            c.fail(f"tensor {name}", f"dims {list(dims)}: each must be in 1..2^40")
        if dims[0] % block:
            c.fail(f"tensor {name}", f"its rows of {dims[0]} are not whole blocks of {block}")
        n = 1
        for d in dims:
            n *= d
        if offset % alignment:
            c.fail(
                f"tensor {name}", f"offset {offset} is not a multiple of the alignment {alignment}"
            )
        tensors.append((offset, n // block * type_size, name))
    start = c.pos + (-c.pos) % alignment
    data = c.size - start
    end_name, end = None, 0
    for offset, nbytes, name in sorted(tensors):
        if offset + nbytes > data:
            c.fail(
                f"tensor {name}",
                f"bytes {offset}..{offset + nbytes} of the data section "
                f"run past the end of the file ({max(data, 0)} bytes)",
            )
        if offset < end:
            c.fail(
                f"tensor {name}", f"its bytes from {offset} overlap tensor {end_name}'s (to {end})"
            )
        end_name, end = name, offset + nbytes
