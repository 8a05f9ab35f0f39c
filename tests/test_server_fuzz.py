"""Fuzzing the server's request handling: thousands of generated and mutated requests (hypothesis,
derandomized: the same cases every run) against an in-process app over a tiny random Qwen3
(and a tiny Qwen3-VL for images). Every reply must be a 2xx (a JSON object, or SSE events
ending in [DONE]) or a 4xx with one OpenAI-shaped JSON error of one line: never a 5xx, a
traceback, a local path or a heap address; each request's share of the memory budget is given
back once its reply is done, and the test process's peak memory stays bounded across the run
(hostile sizes: JSON nested far past MAX_JSON_DEPTH, 40 images and header-only bombs, prompts
at the character cap, bodies up to MAX_BODY_BYTES). Requests that once broke the server are
kept in fuzz_corpus/server_requests.jsonl and replayed first."""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import functools
import io
import json
import random
import re
import struct
import sys
import zlib
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_images import eps_bytes, png_bomb
from test_server import ERROR_KEYS, sse_events

ROOT = Path(__file__).resolve().parents[1]
MAX_MESSAGE_CHARS = 1024  # an error line, its echoes of the request cut
HEAP_ADDRESS = re.compile(r"object at 0x[0-9a-fA-F]+")  # a repr such as <_io.BytesIO ...>
CORPUS = Path(__file__).parent / "fuzz_corpus" / "server_requests.jsonl"
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


def fuzz_settings(n: int):
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=True,
    )


class Harness:
    """One app, its lifespan and an httpx client, on an event loop driven per request."""

    def __init__(self, app):
        self.app = app
        self.loop = asyncio.new_event_loop()
        self.stack = contextlib.AsyncExitStack()
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)

        async def enter():
            await self.stack.enter_async_context(app.router.lifespan_context(app))
            return await self.stack.enter_async_context(
                httpx.AsyncClient(transport=transport, base_url="http://k", timeout=60)
            )

        self.client = self.loop.run_until_complete(enter())
        self.statuses: collections.Counter = collections.Counter()

    def request(self, method: str, path: str, raw: bytes | None = None) -> httpx.Response:
        kw = (
            {} if raw is None else {"content": raw, "headers": {"Content-Type": "application/json"}}
        )
        r = self.loop.run_until_complete(self.client.request(method, path, **kw))
        self.statuses[r.status_code] += 1
        return r

    def close(self):
        self.loop.run_until_complete(self.stack.aclose())
        self.loop.close()


@pytest.fixture(scope="module")
def harness(tmp_path_factory):
    pytest.importorskip("transformers")
    from conftest import make_checkpoint
    from kestrel_cli import Engine

    d = tmp_path_factory.mktemp("fuzz") / "tiny-qwen3"
    make_checkpoint(d, "qwen3")
    yield from _harness(Engine.from_pretrained(d, threads=1, ctx_size=64), d, "requests")


def _harness(eng, d, what: str):
    """A Harness over an app of `eng` (from directory `d`), closed after the module, with
    the statuses it saw printed."""
    from kestrel_cli.server import create_app

    h = Harness(create_app([eng], queue_size=4))
    h.model_dir, h.max_chars = d, eng.tokenizer.max_text_chars(eng.ctx_size)
    yield h
    h.close()
    print(f"\nfuzzed {what} by status: {dict(sorted(h.statuses.items()))}")


@pytest.fixture(scope="module")
def vl_harness(tmp_path_factory):
    """A tiny Qwen3-VL (images reach probe_image, the lease and the vision tower) with room
    for MAX_IMAGES_PER_PROMPT small images in its context."""
    from test_qwen3_vl import make_vl_checkpoint

    from kestrel_cli import Engine

    d = tmp_path_factory.mktemp("fuzzvl") / "tiny-qwen3-vl"
    make_vl_checkpoint(d)
    yield from _harness(Engine.from_pretrained(d, threads=1, ctx_size=512), d, "image requests")


def proc_status(key: str) -> int:
    """A /proc/self/status memory figure (VmHWM: peak RSS; VmRSS) in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no {key} in /proc/self/status")


@pytest.fixture(scope="module")
def peak0(harness, vl_harness) -> int:
    """The test process's memory once both models are loaded: the peak (VmHWM) is reset to
    the current RSS (clear_refs 5; where the kernel refuses, the peak so far is kept, which
    only makes the final bound looser), and that is the baseline the fuzz run's peak is held
    to (test_big_bodies_keep_memory_bounded)."""
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")
    return proc_status("VmHWM")


def check(h: Harness, r: httpx.Response, what) -> None:
    """The reply to any request: 2xx or 4xx, JSON (or SSE), no traceback, no local path."""
    text = r.text
    assert r.status_code < 500, (what, r.status_code, text[:500])
    for leak in ("Traceback", str(ROOT), str(h.model_dir.parent), sys.prefix):
        assert leak not in text, (what, leak, text[:500])
    assert not HEAP_ADDRESS.search(text), (what, text[:500])
    # the request's lease (made by _FrontDoor, released after the reply) is all given back
    assert h.app.state.budget.used == 0, (what, h.app.state.budget.used)
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == ERROR_KEYS and isinstance(err["message"], str) and err["message"]
        assert "\n" not in err["message"], (what, err["message"][:500])  # one line
        # what it echoes of the request is cut (errors.clip): a hostile key or path of a
        # megabyte must not come back (and into the log line) whole
        assert len(err["message"]) <= MAX_MESSAGE_CHARS, (
            what,
            len(err["message"]),
            err["message"][:300],
        )
        assert len(str(err["param"])) <= MAX_MESSAGE_CHARS, (what, str(err["param"])[:300])
        assert err["type"] != "server_error", (what, err)
        return
    if r.headers["content-type"].startswith("text/event-stream"):
        events = sse_events(text.splitlines())
        assert events and events[-1] == "[DONE]", (what, text[-500:])
        for e in events[:-1]:
            assert isinstance(e, dict) and ("choices" in e or "error" in e), (what, e)
            if "error" in e:
                assert e["error"]["type"] != "server_error", (what, e)
        return
    body = r.json()
    assert isinstance(body, dict), (what, text[:500])


def send(h: Harness, path: str, body, method: str = "POST") -> httpx.Response:
    raw = body if isinstance(body, bytes) else dumps(body)  # ASCII: \ud800 kept
    r = h.request(method, path, raw)
    check(h, r, (path, raw[:300]))
    return r


# ---------------------------------------------------------------------------- strategies


def _with_surrogate(s: str, i: int, c: int) -> str:
    i = i % (len(s) + 1)
    return s[:i] + chr(c) + s[i:]


TEXT = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        [
            "",
            " ",
            "\x00",
            "<|im_start|>",
            "<|im_end|>",
            "{{ 7*7 }}",
            "{% if %}",
            "<think>",
            "</think>",
            "<tool_call>",
            "\U0001f985",
            "你好",
            "a" * 300,
            "data:image/png;base64,",
            "http://x/y.png",
            "\\ud800",
        ]
    ),
    st.builds(
        _with_surrogate, st.text(max_size=10), st.integers(0, 10), st.integers(0xD800, 0xDFFF)
    ),
)
SCALAR = st.one_of(
    st.none(),
    st.booleans(),
    TEXT,
    st.integers(-2, 70),
    st.sampled_from([-(2**63), 2**63, 2**64, 10**30, -(10**30)]),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 1e-320, 1e308, -1.5, 0.5, 2.0, 100.0, 101.0]),
)
JSON = st.recursive(
    SCALAR,
    lambda ch: st.lists(ch, max_size=4) | st.dictionaries(TEXT, ch, max_size=4),
    max_leaves=10,
)

_PNG = None


def png() -> str:
    global _PNG
    if _PNG is None:
        from PIL import Image

        buf = io.BytesIO()
        Image.new("RGB", (4, 4), (200, 10, 10)).save(buf, "PNG")
        _PNG = base64.b64encode(buf.getvalue()).decode()
    return _PNG


IMAGE_URL = st.one_of(
    st.just("png"),
    st.sampled_from(
        [
            "data:",
            "data:image/png;base64,",
            "data:,",
            "data:image/png;base64,!!!",
            "data:text/plain,hi",
            "file:///etc/passwd",
            "http://127.0.0.1/x.png",
        ]
    ),
    st.binary(max_size=64).map(lambda b: "data:image/png;base64," + base64.b64encode(b).decode()),
    st.sampled_from(["img:bomb", "img:eps_as_png", "img:b64_cut", "img:tiff_as_png"]),
    TEXT,
)
PART = st.one_of(
    st.fixed_dictionaries({"type": st.just("text"), "text": TEXT}),
    st.fixed_dictionaries(
        {
            "type": st.just("image_url"),
            "image_url": st.one_of(st.fixed_dictionaries({"url": IMAGE_URL}), IMAGE_URL, JSON),
        }
    ),
    st.dictionaries(st.sampled_from(["type", "text", "image_url", "image"]), JSON, max_size=3),
)
ROLE = st.one_of(
    st.sampled_from(["system", "developer", "user", "assistant", "tool", "function", "robot", ""]),
    JSON,
)
TOOL_CALL = st.one_of(
    JSON,
    st.fixed_dictionaries(
        {
            "id": st.one_of(TEXT, JSON),
            "type": st.just("function"),
            "function": st.fixed_dictionaries(
                {"name": TEXT, "arguments": st.one_of(TEXT, st.just('{"a": 1}'), JSON)}
            ),
        }
    ),
)
MESSAGE = st.one_of(
    st.fixed_dictionaries(
        {"role": ROLE, "content": st.one_of(TEXT, st.lists(PART, max_size=3), JSON)},
        optional={
            "tool_call_id": st.one_of(TEXT, JSON),
            "tool_calls": st.one_of(st.lists(TOOL_CALL, max_size=2), JSON),
            "reasoning_content": st.one_of(TEXT, JSON),
            "name": TEXT,
            "function_call": JSON,
        },
    ),
    JSON,
)
SCHEMA = st.one_of(
    JSON,
    st.sampled_from(
        [
            {"type": "object"},
            {"type": "string", "maxLength": 3},
            {"type": "integer", "minimum": 5, "maximum": 3},
            {"enum": []},
            {"type": "array", "minItems": 100000},
            {"$ref": "#/nope"},
            {"type": "string", "pattern": "(((a+)+)+)+$"},
            {"anyOf": []},
            {"type": "nope"},
            {"not": {}},
            {"const": None},
            True,
            False,
        ]
    ),
)
TOOL = st.one_of(
    JSON,
    st.fixed_dictionaries(
        {
            "type": st.one_of(st.just("function"), JSON),
            "function": st.one_of(
                JSON,
                st.fixed_dictionaries(
                    {"name": TEXT}, optional={"description": TEXT, "parameters": SCHEMA}
                ),
            ),
        }
    ),
)
FIELDS = {
    "model": TEXT,
    "temperature": SCALAR,
    "top_p": SCALAR,
    "top_k": SCALAR,
    "min_p": SCALAR,
    "repeat_penalty": SCALAR,
    "seed": SCALAR,
    "max_tokens": SCALAR,
    "max_completion_tokens": SCALAR,
    "ignore_eos": SCALAR,
    "cache_prompt": SCALAR,
    "stream": st.one_of(st.booleans(), SCALAR),
    "stream_options": st.one_of(JSON, st.fixed_dictionaries({"include_usage": SCALAR})),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=20), JSON),
    "chat_template_kwargs": st.one_of(
        JSON,
        st.fixed_dictionaries({"enable_thinking": SCALAR}),
        st.dictionaries(TEXT, JSON, max_size=3),
    ),
    "reasoning_effort": st.one_of(st.sampled_from(["none", "low", "high", "max"]), JSON),
    "presence_penalty": SCALAR,
    "frequency_penalty": SCALAR,
    "logit_bias": st.one_of(
        JSON, st.dictionaries(st.one_of(st.integers(-5, 400).map(str), TEXT), SCALAR, max_size=5)
    ),
    "logprobs": SCALAR,
    "top_logprobs": SCALAR,
    "response_format": st.one_of(
        JSON,
        st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
            optional={
                "json_schema": st.one_of(
                    JSON,
                    st.fixed_dictionaries(
                        {"name": TEXT}, optional={"schema": SCHEMA, "strict": SCALAR}
                    ),
                )
            },
        ),
    ),
    "tools": st.one_of(st.lists(TOOL, max_size=3), JSON),
    "tool_choice": st.one_of(
        st.sampled_from(["none", "auto", "required"]),
        JSON,
        st.fixed_dictionaries(
            {"type": st.just("function"), "function": st.fixed_dictionaries({"name": TEXT})}
        ),
    ),
    "n": SCALAR,
    "echo": SCALAR,
    "suffix": SCALAR,
    "best_of": SCALAR,
    "user": JSON,
    "functions": JSON,
    "function_call": JSON,
    "modalities": JSON,
    "audio": JSON,
    "parallel_tool_calls": SCALAR,
    "metadata": JSON,
}
# values a client might really send: most requests get past validation and generate
PLAUSIBLE = {
    "temperature": st.sampled_from([0, 0.0, 0.7, 1, 2.0]),
    "top_p": st.sampled_from([0, 0.5, 1]),
    "top_k": st.integers(0, 50),
    "min_p": st.sampled_from([0, 0.05, 1]),
    "repeat_penalty": st.sampled_from([0.5, 1, 1.3]),
    "seed": st.integers(-(2**63), 2**64),
    "max_tokens": st.integers(1, 80),
    "max_completion_tokens": st.integers(1, 8),
    "ignore_eos": st.booleans(),
    "cache_prompt": st.booleans(),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.one_of(TEXT, st.lists(TEXT, max_size=4)),
    "chat_template_kwargs": st.fixed_dictionaries({"enable_thinking": st.booleans()}),
    "reasoning_effort": st.sampled_from(["none", "low", "high"]),
    "presence_penalty": st.sampled_from([-2, 0, 1.5]),
    "frequency_penalty": st.just(0.5),
    "logit_bias": st.dictionaries(
        st.integers(0, 319).map(str), st.sampled_from([-100, -1, 5, 100]), max_size=3
    ),
    "logprobs": st.one_of(st.booleans(), st.integers(0, 5)),
    "top_logprobs": st.integers(0, 5),
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {
                "type": "json_schema",
                "json_schema": {
                    "name": "p",
                    "schema": {
                        "type": "object",
                        "properties": {"a": {"type": "integer"}},
                        "required": ["a"],
                    },
                },
            },
        ]
    ),
    "tools": st.just(
        [
            {
                "type": "function",
                "function": {
                    "name": "f",
                    "parameters": {"type": "object", "properties": {"x": {"type": "string"}}},
                },
            }
        ]
    ),
    "tool_choice": st.sampled_from(["none", "auto", "required"]),
}
BASE_CHAT = {
    "messages": [{"role": "user", "content": "The kestrel hovers"}],
    "max_tokens": 2,
    "temperature": 0,
}
BASE_COMPLETION = {"prompt": "The kestrel hovers", "max_tokens": 2, "temperature": 0}


@st.composite
def mutated(draw, base: dict, extra: dict):
    """`base` with a few fields replaced by generated (mostly wrong) values or removed."""
    body = dict(base)
    fields = {**FIELDS, **extra}
    for name in draw(st.lists(st.sampled_from(sorted(fields)), max_size=4, unique=True)):
        plausible = name in PLAUSIBLE and draw(st.integers(0, 3)) > 0
        body[name] = draw(PLAUSIBLE[name] if plausible else fields[name])
    for name in draw(st.lists(st.sampled_from(sorted(base)), max_size=1)):
        body.pop(name, None)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 8:
        body["max_tokens"] = draw(st.sampled_from([8, body["max_tokens"]]))
    return body


def _resolve_png(v):
    """Image markers -> data URLs: "png" (a 4x4 PNG) and "img:NAME" (IMAGES)."""
    if v == "png":
        return "data:image/png;base64," + png()
    if isinstance(v, str) and v.startswith("img:") and v[4:] in IMAGES:
        return image_url(v[4:])
    if isinstance(v, dict):
        return {k: _resolve_png(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_resolve_png(x) for x in v]
    return v


# -- deep JSON: far past constrained.MAX_JSON_DEPTH (64) and past Python's recursion limit


class Deep:
    """A JSON value nested `levels` deep ([] is 1 level, as constrained.too_deep counts),
    kept as text: json.dumps and json.loads recurse once per level, and 5,000 levels is past
    Python's recursion limit, so it is built by repetition and spliced into the body by
    dumps(). `as_string`: sent as a JSON string holding that text (tool-call arguments)."""

    SHAPES = {  # opening, closing, levels each step adds
        "list": ("[", "]", 1),
        "dict": ('{"a": ', "}", 1),
        "wide": ('[1, "x", true, {"k": 2.5, "n": ', "}]", 2),
        "items": ('{"type": "array", "items": ', "}", 1),
        "properties": ('{"type": "object", "properties": {"a": ', "}}", 2),
        "anyOf": ('{"anyOf": [', "]}", 2),
        "list_dict": ('[{"a": ', "}]", 2),
    }
    LEAVES = ("null", "1", '"x"', '{"type": "integer"}', '"\\ud800"', "[]")

    def __init__(
        self, levels: int, shape: str = "list", leaf: str = "null", as_string: bool = False
    ):
        self.levels, self.shape, self.leaf, self.as_string = levels, shape, leaf, as_string

    def __repr__(self) -> str:  # hypothesis's falsifying examples print this
        return (
            f"Deep({self.levels}, {self.shape!r}, {self.leaf!r}"
            f"{', as_string=True' if self.as_string else ''})"
        )

    def text(self) -> str:
        op, cl, per = self.SHAPES[self.shape]
        inner = self.levels - (self.leaf[:1] in "[{")  # the leaf's own level
        steps, rest = divmod(max(inner, 0), per)
        # an odd level left over: one more level of the shape's own kind (a schema stays one)
        fo, fc = ('{"items": ', "}") if op[0] == "{" else ("[", "]")
        t = op * steps + fo * rest + self.leaf + fc * rest + cl * steps
        return json.dumps(t) if self.as_string else t


def dumps(body) -> bytes:
    """`body` as JSON bytes (ASCII), each Deep spliced in as its text."""
    raws: list[str] = []

    def sub(v):
        if isinstance(v, Deep):
            raws.append(v.text())
            return f"\0deep{len(raws) - 1}\0"
        if isinstance(v, dict):
            return {k: sub(x) for k, x in v.items()}
        if isinstance(v, list):
            return [sub(x) for x in v]
        return v

    text = json.dumps(sub(body))
    for i, raw in enumerate(raws):
        text = text.replace(json.dumps(f"\0deep{i}\0"), raw, 1)
    return text.encode()


# -- images: valid small ones of each accepted format, header-only bombs, wrong formats and
# broken base64 (the server reads headers before any pixel: tests/test_images.py)


def _png_chunk(kind: bytes, body: bytes) -> bytes:
    return (
        struct.pack(">I", len(body))
        + kind
        + body
        + struct.pack(">I", zlib.crc32(kind + body) & 0xFFFFFFFF)
    )


def png_header(width: int, height: int) -> bytes:
    """A PNG of a header and no pixel data: what probe_image reads; decoding it fails."""
    return (
        b"\x89PNG\r\n\x1a\n"
        + _png_chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
        + _png_chunk(b"IEND", b"")
    )


def _pil_bytes(fmt: str, size=(8, 8)) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, (10, 120, 200)).save(buf, fmt)
    return buf.getvalue()


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


IMAGES = {  # name -> (a data URL's mime, its base64 text)
    "png": lambda: ("image/png", png()),
    "jpeg": lambda: ("image/jpeg", _b64(_pil_bytes("JPEG"))),
    "gif": lambda: ("image/gif", _b64(_pil_bytes("GIF"))),
    "webp": lambda: ("image/webp", _b64(_pil_bytes("WEBP"))),
    "bmp": lambda: ("image/bmp", _b64(_pil_bytes("BMP"))),
    "jpeg_as_png": lambda: ("image/png", _b64(_pil_bytes("JPEG"))),
    "tiff_as_png": lambda: ("image/png", _b64(_pil_bytes("TIFF"))),
    "ico_as_png": lambda: ("image/png", _b64(_pil_bytes("ICO", (16, 16)))),
    "eps_as_png": lambda: ("image/png", _b64(eps_bytes())),
    "bomb": lambda: ("image/png", _b64(png_bomb(9000, 9000))),  # 81 M pixels in ~10 KB
    "bomb_wide": lambda: ("image/png", _b64(png_header(1, 99_000_000))),
    "bomb_long": lambda: ("image/png", _b64(png_header(99_000_000, 1))),
    "huge_dims": lambda: ("image/png", _b64(png_header(2**31 - 1, 2**31 - 1))),
    "zero_dims": lambda: ("image/png", _b64(png_header(0, 0))),
    "aspect": lambda: ("image/png", _b64(png_header(20_000, 1))),  # few pixels, too wide
    "header_only": lambda: ("image/png", _b64(png_header(64, 64))),
    "png64": lambda: ("image/png", _b64(png_bomb(64, 64))),
    "png64_cut": lambda: ("image/png", _b64(png_bomb(64, 64)[:-30])),
    "png_2mpx": lambda: ("image/png", _b64(png_bomb(2000, 1000))),  # decoded, then resized
    "signature": lambda: ("image/png", _b64(b"\x89PNG\r\n\x1a\n")),
    "b64_garbage": lambda: ("image/png", "!!!~~~" + png()[:40]),
    "b64_unpadded": lambda: ("image/png", png().rstrip("=")),
    "b64_cut": lambda: ("image/png", png()[: len(png()) // 2 * 2 + 1]),
    "b64_lines": lambda: ("image/png", "\n".join(png()[i : i + 16] for i in range(0, 200, 16))),
    "b64_empty": lambda: ("image/png", ""),
    "not_base64": lambda: ("image/png;charset=utf-8", png()),
}


@functools.lru_cache(maxsize=None)
def image_url(name: str) -> str:
    mime, data = IMAGES[name]()
    return f"data:{mime}" + ("" if mime.endswith("utf-8") else ";base64") + "," + data


# -- long prompts: text at the server's character cap (Tokenizer.max_text_chars of the
# context) or around the context in tokens


def long_text(kind: str, n: int, seed: int = 0) -> str:
    """`n` characters: CJK (several byte-level tokens each), ASCII, words, emoji (a UTF-16
    pair each on the wire), combining marks (NFC), newlines, chat special tokens."""
    if kind == "cjk":
        rnd = random.Random(seed)
        return "".join(chr(rnd.randint(0x4E00, 0x9FFF)) for _ in range(n))
    unit = {
        "ascii": "a",
        "words": "The kestrel hovers ",
        "emoji": "\U0001f985",
        "marks": "e\u0301",
        "newlines": "\n",
        "special": "<|im_start|>",
    }[kind]
    return (unit * (n // len(unit) + 1))[:n]


TEXT_KINDS = ("cjk", "ascii", "words", "emoji", "marks", "newlines", "special")


# -- hostile sizes (issue 33): deep JSON, many images, prompts at the caps

# around MAX_JSON_DEPTH, and far past it (past ~900 levels json.loads itself gives up)
LEVELS = st.one_of(st.integers(58, 70), st.integers(500, 5000))
SCHEMA_SHAPES = ("properties", "items", "anyOf", "dict", "wide")


def deep(shapes=tuple(Deep.SHAPES), as_string=st.just(False)):
    return st.builds(Deep, LEVELS, st.sampled_from(shapes), st.sampled_from(Deep.LEAVES), as_string)


def _tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def _assistant_call(arguments) -> list[dict]:
    return [
        {"role": "user", "content": "hi"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]


# where a deep value goes: (the shapes that suit the place, a function putting `d` there)
DEEP_PLACES = {
    "tools.parameters": (SCHEMA_SHAPES, lambda b, d: b.update(tools=[_tool(d)])),
    "tools.property": (
        SCHEMA_SHAPES,
        lambda b, d: b.update(tools=[_tool({"type": "object", "properties": {"x": d}})]),
    ),
    "tools": (tuple(Deep.SHAPES), lambda b, d: b.update(tools=[d])),
    "arguments": (
        ("dict", "properties", "list_dict", "wide"),
        lambda b, d: b.update(messages=_assistant_call(d)),
    ),
    "arguments_string": (
        tuple(Deep.SHAPES),
        lambda b, d: b.update(
            messages=_assistant_call(Deep(d.levels, d.shape, d.leaf, as_string=True))
        ),
    ),
    "response_format": (
        SCHEMA_SHAPES,
        lambda b, d: b.update(
            response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": d}}
        ),
    ),
    "chat_template_kwargs": (
        ("dict", "list_dict"),
        lambda b, d: b.update(chat_template_kwargs={"k": d}),
    ),
    "chat_template_kwargs.self": (("dict",), lambda b, d: b.update(chat_template_kwargs=d)),
    "content": (
        tuple(Deep.SHAPES),
        lambda b, d: b.update(messages=[{"role": "user", "content": d}]),
    ),
    "content.text": (
        tuple(Deep.SHAPES),
        lambda b, d: b.update(
            messages=[{"role": "user", "content": [{"type": "text", "text": d}]}]
        ),
    ),
    "content.image_url": (
        tuple(Deep.SHAPES),
        lambda b, d: b.update(
            messages=[{"role": "user", "content": [{"type": "image_url", "image_url": d}]}]
        ),
    ),
    "message": (
        ("dict", "list_dict"),
        lambda b, d: b.update(messages=[{"role": "user", "content": "hi", "extra": d}]),
    ),
    "messages": (tuple(Deep.SHAPES), lambda b, d: b.update(messages=d)),
    "body": (("dict",), lambda b, d: b.update(nested=d)),
}
DEEP_FIELDS = (
    "stop",
    "logit_bias",
    "metadata",
    "user",
    "stream_options",
    "tool_choice",
    "reasoning_effort",
    "seed",
    "temperature",
    "max_tokens",
    "functions",
    "modalities",
    "response_format",
    "tools",
)


@st.composite
def deep_request(draw):
    """A chat or completion request with one value nested around or far past 64 levels."""
    place = draw(st.sampled_from(sorted(DEEP_PLACES) + ["field", "prompt"]))
    body = dict(BASE_CHAT)
    if place == "prompt":
        body = dict(BASE_COMPLETION, prompt=draw(st.one_of(deep(), st.lists(deep(), max_size=2))))
        return COMPLETIONS, body
    if place == "field":
        body[draw(st.sampled_from(DEEP_FIELDS))] = draw(deep())
    else:
        shapes, put = DEEP_PLACES[place]
        put(body, draw(deep(shapes)))
    if "tools" in body:  # a forced call compiles its parameters into a grammar
        choice = draw(
            st.sampled_from(
                [None, "auto", "required", "none", {"type": "function", "function": {"name": "f"}}]
            )
        )
        if choice is not None:
            body["tool_choice"] = choice
    if draw(st.integers(0, 3)) == 0:
        body["stream"] = True
    return (COMPLETIONS if place == "body" and draw(st.booleans()) else CHAT), body


# many images: up to 40 parts of every kind, runs of one kind around MAX_IMAGES_PER_PROMPT
IMAGE_NAME = st.sampled_from(sorted(IMAGES))
IMAGE_PART = st.builds(
    lambda name, wrapped: {
        "type": "image_url",
        "image_url": {"url": "img:" + name} if wrapped else "img:" + name,
    },
    IMAGE_NAME,
    st.booleans(),
)
TEXT_PART = st.fixed_dictionaries(
    {
        "type": st.just("text"),
        "text": st.sampled_from(
            [
                "Compare.",
                "",
                "\n",
                "你好",
                "<|im_start|>",
                "\U0001f985",
                "<|image_pad|>",
                "<|vision_start|><|image_pad|><|vision_end|>",
            ]
        ),
    }
)
MANY_IMAGES = st.one_of(
    st.lists(st.one_of(IMAGE_PART, TEXT_PART), min_size=1, max_size=40),
    st.builds(lambda part, n: [part] * n, IMAGE_PART, st.integers(1, 40)),
    # small valid images up to MAX_IMAGES_PER_PROMPT and past it, then one of any kind
    st.builds(
        lambda n, last: [{"type": "image_url", "image_url": {"url": "img:png"}}] * n + [last],
        st.integers(24, 34),
        IMAGE_PART,
    ),
)


# long prompts: (kind, characters as "cap"+delta, or a count near the context in tokens)
LONG_TEXT = st.one_of(
    st.tuples(st.sampled_from(TEXT_KINDS), st.just("cap"), st.integers(-40, 40)),
    st.tuples(st.sampled_from(TEXT_KINDS), st.just("n"), st.integers(10, 90)),
    st.tuples(st.sampled_from(TEXT_KINDS), st.just("n"), st.integers(150, 300)),
)
LONG_PLACES = (
    "content",
    "parts",
    "messages",
    "system",
    "tool_description",
    "prompt",
    "prompt_list",
    "stop",
)


def place_long(place: str, text: str, seed: int) -> tuple[str, dict]:
    """A request carrying `text` at `place` (split in pieces where the place takes several)."""
    k = max(1, len(text) // (2 + seed % 5))
    pieces = [text[i : i + k] for i in range(0, len(text), k)] or [""]
    chat = dict(BASE_CHAT)
    if place == "content":
        chat["messages"] = [{"role": "user", "content": text}]
    elif place == "parts":
        chat["messages"] = [
            {"role": "user", "content": [{"type": "text", "text": t} for t in pieces]}
        ]
    elif place == "messages":
        roles = ("user", "assistant")
        chat["messages"] = [{"role": roles[i % 2], "content": t} for i, t in enumerate(pieces)]
    elif place == "system":
        chat["messages"] = [{"role": "system", "content": text}] + BASE_CHAT["messages"]
    elif place == "tool_description":
        chat["tools"] = [
            {
                "type": "function",
                "function": {"name": "f", "description": text, "parameters": {"type": "object"}},
            }
        ]
    elif place == "stop":
        chat["stop"] = pieces[:4]
    elif place == "prompt":
        return COMPLETIONS, dict(BASE_COMPLETION, prompt=text)
    else:
        return COMPLETIONS, dict(BASE_COMPLETION, prompt=[text])
    return CHAT, chat


# ---------------------------------------------------------------------------- the tests

GEN = re.compile(r'"@gen ([^"]*)"')
GEN_LEAVES = {"null": "null", "int": '{"type": "integer"}', "surrogate": '"\\ud800"'}


def generate(spec: str, h: Harness) -> str:
    """The JSON text a corpus marker "@gen KIND ARG..." stands for (values too big or too deep
    to store): `deep SHAPE LEVELS [LEAF]` and `deep_string SHAPE LEVELS [LEAF]` (Deep; LEAF
    null, int or surrogate), `image NAME` (IMAGES), `image_parts N NAME` (N image_url parts
    and a text part), `text KIND N` (long_text; N a count, or cap, cap+K, cap-K: the
    server's character cap, Tokenizer.max_text_chars of its context)."""
    kind, *args = spec.split()
    if kind in ("deep", "deep_string"):
        leaf = GEN_LEAVES[args[2] if len(args) > 2 else "null"]
        return Deep(int(args[1]), args[0], leaf, kind == "deep_string").text()
    if kind == "image":
        return json.dumps(image_url(args[0]))
    if kind == "image_parts":
        return json.dumps(
            [{"type": "image_url", "image_url": {"url": image_url(args[1])}}] * int(args[0])
            + [{"type": "text", "text": "Compare."}]
        )
    if kind == "text":
        n = args[1]
        n = h.max_chars + int(n[3:] or 0) if n.startswith("cap") else int(n)
        return json.dumps(long_text(args[0], n))
    raise ValueError(f"unknown corpus marker {spec!r}")


def corpus() -> list[dict]:
    return [json.loads(line) for line in CORPUS.read_text().splitlines() if line.strip()]


def test_corpus_of_requests_that_once_failed(harness, vl_harness, peak0):
    """Every stored request (`"model": "vl"`: sent to the Qwen3-VL app); every failure is
    reported, not only the first."""
    cases = corpus()
    assert len(cases) >= 10
    failures = []
    for case in cases:
        h = vl_harness if case.get("model") == "vl" else harness
        raw = (
            bytes.fromhex(case["body_hex"])
            if "body_hex" in case
            else GEN.sub(lambda m: generate(m.group(1), h), case["body"]).encode()
        )
        try:
            r = h.request(case.get("method", "POST"), case["path"], raw)
            check(h, r, case["path"])
            if "status" in case:
                assert r.status_code == case["status"], (r.status_code, r.text[:300])
            if "param" in case:
                assert r.json()["error"]["param"] == case["param"], r.text[:300]
        except AssertionError as e:
            failures.append(f"{case.get('why', case['body'][:80])}: {str(e)[:400]}")
    assert not failures, "\n".join(failures)


@fuzz_settings(1200)
@given(body=mutated(BASE_CHAT, {"messages": st.one_of(st.lists(MESSAGE, max_size=3), JSON)}))
def test_fuzz_chat_fields(harness, body):
    send(harness, CHAT, _resolve_png(body))


@fuzz_settings(500)
@given(messages=st.lists(MESSAGE, min_size=1, max_size=4), stream=st.booleans())
def test_fuzz_chat_messages(harness, messages, stream):
    send(harness, CHAT, _resolve_png({"messages": messages, "max_tokens": 2, "stream": stream}))


@fuzz_settings(600)
@given(
    body=mutated(
        BASE_COMPLETION,
        {
            "prompt": st.one_of(
                TEXT, st.lists(st.integers(-3, 400), max_size=70), st.lists(TEXT, max_size=2), JSON
            )
        },
    )
)
def test_fuzz_completion_fields(harness, body):
    send(harness, COMPLETIONS, body)


@fuzz_settings(600)
@given(
    base=st.sampled_from(
        [
            (CHAT, BASE_CHAT),
            (COMPLETIONS, BASE_COMPLETION),
            (CHAT, {**BASE_CHAT, "stream": True, "response_format": {"type": "json_object"}}),
        ]
    ),
    edits=st.lists(
        st.tuples(st.integers(0, 10**6), st.sampled_from("dir"), st.binary(min_size=1, max_size=3)),
        min_size=1,
        max_size=4,
    ),
)
def test_fuzz_raw_bytes(harness, base, edits):
    """Byte-level mutations of valid bodies: deleted, inserted and replaced bytes (invalid
    UTF-8, broken JSON, stray escapes)."""
    path, body = base
    raw = bytearray(json.dumps(body).encode())
    for pos, op, b in edits:
        pos %= len(raw) + 1
        if op == "d":
            del raw[pos : pos + len(b)]
        elif op == "i":
            raw[pos:pos] = b
        else:
            raw[pos : pos + len(b)] = b
    send(harness, path, bytes(raw))


@fuzz_settings(300)
@given(
    path=st.sampled_from(
        [
            CHAT,
            COMPLETIONS,
            "/v1/models",
            "/health",
            "/v1/models/x",
            "/v1/embeddings",
            "/v1/chat/completions/",
        ]
    ),
    method=st.sampled_from(["POST", "GET", "PUT", "DELETE"]),
    body=JSON,
)
def test_fuzz_any_json_to_any_route(harness, path, method, body):
    send(harness, path, body, method)


@fuzz_settings(2000)
@given(req=deep_request())
def test_fuzz_deep_json(harness, req):
    """JSON nested around MAX_JSON_DEPTH (58-70 levels) and far past it (500-5000) in tool
    parameters, tool-call arguments (objects and JSON strings), response_format schemas,
    chat_template_kwargs, message content and any field: a 4xx or an answer, never a
    RecursionError."""
    path, body = req
    send(harness, path, body)


@fuzz_settings(1000)
@given(content=MANY_IMAGES, split=st.integers(0, 3), stream=st.booleans())
def test_fuzz_many_images(vl_harness, content, split, stream):
    """Up to 40 image parts (small valid images of each format, 9000x9000 and 1x99,000,000
    header bombs, EPS/TIFF/JPEG sent as image/png, truncated files, broken base64), in one
    message or spread over several: refused from their headers, or answered."""
    messages = [{"role": "user", "content": content}]
    if split:  # the same parts over several user turns
        k = -(-len(content) // (split + 1))
        messages = []
        for i in range(0, len(content), k):
            messages += [
                {"role": "user", "content": content[i : i + k]},
                {"role": "assistant", "content": "Seen."},
            ]
        messages.pop()
    send(vl_harness, CHAT, _resolve_png({"messages": messages, "max_tokens": 2, "stream": stream}))


@fuzz_settings(1200)
@given(spec=LONG_TEXT, place=st.sampled_from(LONG_PLACES), seed=st.integers(0, 9))
def test_fuzz_long_prompts(harness, spec, place, seed):
    """Text at the server's character cap (max_text_chars of the context, +-40), and around
    the context in tokens (CJK: several tokens a character; special-token text), in one
    message, in parts, over many messages, in a tool description, in a completion prompt:
    refused for its characters or its tokens (tokenised only up to the context), or
    answered."""
    kind, base, n = spec
    n = harness.max_chars + n if base == "cap" else n
    send(harness, *place_long(place, long_text(kind, n, seed), seed))


# The test process's peak memory over its baseline (peak0, both models loaded) for the whole
# fuzz run. The largest body is MAX_BODY_BYTES (32 MiB), built once as bytes; the client's
# transport, the server's joined body (BODY_COPIES = 3 leased for it), its decoded text and the
# parsed string make ~5-6 copies, ~200 MiB (measured: +160 MiB for the big bodies alone, +300
# MiB after the whole fuzz run, whose heap stays ~70 MiB larger); tokenising is bounded by a
# context and images are refused from their headers or decoded one at a time, so nothing else
# grows with the input. A near-cap prompt tokenised whole used to peak at 1.2 GB, one request
# decoding eight bomb PNGs at 4.4 GB (one decoded bomb, RGB, is 243 MB).
PEAK_GROWTH = 512 << 20


def test_big_bodies_keep_memory_bounded(harness, vl_harness, peak0):
    """Bodies up to MAX_BODY_BYTES and just over it, the issue's 1.3 M-character prompt
    (7.8 MB), a million-item stop list, 200,000 messages, 300,000 logit_bias entries, bomb
    images and 32 images of 2 M pixels: each refused or answered with its lease given back,
    and the process's peak memory for the whole fuzz run (this test comes last) stays within
    PEAK_GROWTH of its baseline."""
    from kestrel_cli.server.app import MAX_BODY_BYTES

    near = MAX_BODY_BYTES - 200

    def filled(template: bytes, n: int, fill: bytes = b"a") -> bytes:
        """`template` with its "@" replaced by `n` bytes of `fill`: one copy of a big body."""
        head, tail = template.split(b"@")
        return b"".join((head, fill * n, tail))

    cases = [  # (app, route, a function making the body, the status)
        (
            harness,
            CHAT,
            lambda: dumps({"messages": [{"role": "user", "content": long_text("cjk", 1_300_000)}]}),
            400,
        ),
        (harness, COMPLETIONS, lambda: dumps({"prompt": long_text("cjk", 1_300_000)}), 400),
        (
            harness,
            CHAT,
            lambda: filled(b'{"messages": [{"role": "user", "content": "@"}]}', near),
            400,
        ),
        (harness, COMPLETIONS, lambda: filled(b'{"prompt": "@"}', MAX_BODY_BYTES), 413),
        (
            harness,
            CHAT,
            lambda: filled(
                b'{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": "@"}',
                near,
            ),
            200,
        ),
        (harness, CHAT, lambda: dumps({**BASE_CHAT, "stop": ["s"] * 1_000_000}), 400),
        (
            harness,
            CHAT,
            lambda: dumps({**BASE_CHAT, "messages": [{"role": "user", "content": "a"}] * 200_000}),
            400,
        ),
        (
            harness,
            CHAT,
            lambda: dumps({**BASE_CHAT, "logit_bias": {str(i): 1 for i in range(300_000)}}),
            400,
        ),
        (
            vl_harness,
            CHAT,
            lambda: dumps(
                _resolve_png(
                    {
                        **BASE_CHAT,
                        "messages": [
                            {
                                "role": "user",
                                "content": [{"type": "image_url", "image_url": {"url": "img:bomb"}}]
                                * 8,
                            }
                        ],
                    }
                )
            ),
            400,
        ),
        (
            vl_harness,
            CHAT,
            lambda: dumps(
                _resolve_png(
                    {
                        **BASE_CHAT,
                        "messages": [
                            {
                                "role": "user",
                                "content": [
                                    {"type": "image_url", "image_url": {"url": "img:png_2mpx"}}
                                ]
                                * 32,
                            }
                        ],
                    }
                )
            ),
            200,
        ),
    ]
    for h, path, body, status in cases:
        r = send(h, path, body())
        assert r.status_code == status, (path, r.status_code, r.text[:300])
        del r
    grew = proc_status("VmHWM") - peak0
    assert grew < PEAK_GROWTH, f"peak memory grew {grew >> 20} MiB over the fuzz run"
