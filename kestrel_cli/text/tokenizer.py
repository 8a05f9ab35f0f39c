"""Tokenizer: text <-> token ids, chat templates and streaming detokenization.

`Tokenizer` wraps a `tokenizers.Tokenizer` (the Rust backend) built either from a Hugging Face checkpoint
directory (`from_dir`) or from the metadata of a GGUF file (`from_gguf`). It aims to tokenise exactly as
transformers' `AutoTokenizer` does for the same files, with one deliberate exception documented on
`_DIGIT_SPLIT_PRE` (GGUF pre-tokenizers that split digits, such as SmolLM2's "smollm").

`Detokenizer` turns a stream of ids into a stream of text without ever emitting half a UTF-8 character
(`tokenizers.decoders.DecodeStream`).
"""

from __future__ import annotations

import contextvars
import ctypes
import json
import os
import re
import threading
import time
from datetime import datetime
from pathlib import Path
from typing import Any, Iterable, Mapping

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
from tokenizers import Tokenizer as _Backend

from kestrel_cli.core.errors import KestrelError

__all__ = ["Tokenizer", "Detokenizer", "TooManyTokens"]

NO_TEMPLATE_MESSAGE = "model has no chat template; use --raw"

# Tokenizer.encode(limit=...): texts are counted in pieces of this many characters, and each cut between two
# pieces may add up to COUNT_CUT_SLACK tokens the whole text would not have
COUNT_CHUNK_CHARS = 16384
COUNT_CUT_SLACK = 32


class TooManyTokens(KestrelError):
    """A text has more tokens than the caller's limit: `n_tokens` of them exactly, or at least (`exact`
    False: counting stopped once the limit was clearly passed)."""

    def __init__(self, n_tokens: int, limit: int, exact: bool):
        self.n_tokens, self.limit, self.exact = n_tokens, limit, exact
        super().__init__(
            f"the text has {'' if exact else 'at least '}{n_tokens} tokens, more than the "
            f"{limit} allowed"
        )


# ---------------------------------------------------------------------------------------------------------------------
# GGUF pre-tokenizers.
#
# llama.cpp names the pre-tokenizer of a byte-level BPE vocabulary in `tokenizer.ggml.pre`. transformers
# (integrations/gguf/gguf_tokenizer_mapping.py) maps known names to `Split(regex, "isolated")` followed by
# `ByteLevel(add_prefix_space=False, use_regex=False)`, and every other name to GPT-2's plain
# `ByteLevel(add_prefix_space=False, use_regex=True)`. The table holds only the names that come with the GGUF
# architectures the loader accepts (llama, qwen2, qwen3); the regexes are transformers' verbatim.
# ---------------------------------------------------------------------------------------------------------------------

_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN_SPLIT = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_REGEX_SPLIT_PRE = {
    # architecture llama: Llama 3 and models built on its tokenizer; Mistral's tekken (Mistral Nemo)
    **dict.fromkeys(
        ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "falcon3", "pixtral"), _LLAMA3_SPLIT
    ),
    "tekken": _TEKKEN_SPLIT,
    # architectures qwen2 and qwen3
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT),
}

# llama.cpp splits every digit off first (regex "\p{N}"), then applies the GPT-2 regex, for these names (llama
# architecture: SmolLM/SmolLM2, Minerva); the original tokenizer.json files say the same:
# Sequence[Digits(individual_digits=True), ByteLevel(use_regex=True)].
# transformers 5.x does NOT know these names and falls back to plain GPT-2 ByteLevel. Because these vocabularies
# have no merges joining digits, the two agree on almost every string, but not on a run of 2+ spaces before a
# digit ("a  1": we give [a, "ĠĠ", 1] like llama.cpp and the original tokenizer; transformers gives [a, Ġ, Ġ, 1]).
# We follow llama.cpp / the original tokenizer, since that is what the model was trained on.
_DIGIT_SPLIT_PRE = frozenset(("smollm", "minerva-7b"))

# Control tokens that llama.cpp treats as end-of-generation when present (besides eos/eot/eom ids).
_EOG_TEXTS = frozenset(
    (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<|return|>",
        "<|call|>",
    )
)

# SentencePiece ("llama") vocabularies of these architectures need fixes we do not implement (see transformers'
# gemma_tokenizer / phi3_tokenizer); refuse them rather than tokenise subtly wrong.
_UNSUPPORTED_SPM_ARCHS = frozenset(("gemma", "gemma2", "gemma3", "phi3"))

_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (same as transformers.convert_slow_tokenizer.bytes_to_unicode)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


# ---------------------------------------------------------------------------------------------------------------------
# Chat templates: rendered like transformers.utils.chat_template_utils.
# ---------------------------------------------------------------------------------------------------------------------

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_template_cache: dict[
    str, Any
] = {}  # source -> the compiled template, or the KestrelError compiling it raised

# A chat template is a program: rendering gets a time and a size limit. Time: every intercepted operation and
# every output chunk checks the deadline, and a watchdog interrupts loops that do neither. Size: values made by
# `*`, `**`, `+`, `%`, `~`, calls and filters are checked before they are built where Python would build them in
# one C call (a width of 10**10, 'a' * 3000000000), and the output is counted as it streams.
TEMPLATE_SECONDS = 5.0
TEMPLATE_MAX_CHARS = 32 << 20  # default size limit for one value and for the output, in characters
_MAX_INT_BITS = 1 << 16  # ints in templates are counters and ids, not bignums
# Levels of lists/dicts in each piece of data a template gets (a message, a tool, a document, a keyword argument;
# the piece itself is level 1), checked without recursion before it is copied (_plain recurses once per level, as
# do tojson and templates that walk a schema). An API request's JSON values are bounded at 64 levels
# (constrained.MAX_JSON_DEPTH) and sit a few levels inside a message or a tool; 128 leaves room for that.
TEMPLATE_MAX_DEPTH = 128


class _TemplateTimeout(Exception):
    """Raised in the rendering thread by the watchdog."""


class _Limits:
    def __init__(self, seconds: float, max_chars: int):
        self.deadline = time.monotonic() + seconds
        self.seconds, self.max_chars = seconds, max_chars

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise KestrelError(f"chat template error: rendering took more than {self.seconds:g} s")

    def size(self, n: int, what: str, limit: int | None = None) -> None:
        limit = self.max_chars if limit is None else limit
        if n > limit:
            raise KestrelError(
                f"chat template error: {what} of size {n}, over the limit of {limit}"
            )
        self.tick()


_limits: contextvars.ContextVar[_Limits] = contextvars.ContextVar("kestrel_template_limits")
_WIDTH = re.compile(r"\d+")


def _length(x: Any) -> int:
    return len(x) if isinstance(x, (str, list, tuple, dict)) else 0


def _deep_len(x: Any, cap: int) -> int:
    """Characters of the strings inside x (lists, tuples, dicts walked), counting up to just past `cap`:
    roughly what str(x) or tojson(x) would allocate ([s] * 1000 holds one string a thousand times)."""
    total, todo = 0, [x]
    while todo and total <= cap:
        v = todo.pop()
        if isinstance(v, str):
            total += len(v)
        elif isinstance(v, (list, tuple)):
            total += len(v)
            todo.extend(v)
        elif isinstance(v, dict):
            total += len(v)
            todo.extend(v.keys())
            todo.extend(v.values())
    return total


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _check_widths(lim: _Limits, args: Iterable[Any], what: str) -> None:
    """Widths, counts and repeat arguments must stay under the size limit (str.center(10**10), indent(10**10))."""
    for a in args:
        if _is_int(a) and abs(a) > lim.max_chars:
            lim.size(abs(a), what)


def _check_values(lim: _Limits, args: Iterable[Any], what: str) -> None:
    """What turning the arguments into text could allocate."""
    lim.size(sum(_deep_len(a, lim.max_chars) for a in args), what)


def _check_format(lim: _Limits, fmt: Any, what: str) -> None:
    """A width or precision written in a format string ('%10000000000s', '{:>10000000000}')."""
    if isinstance(fmt, str) and ("%" in fmt or "{" in fmt):
        for m in _WIDTH.findall(fmt):
            if len(m) > 12 or int(m) > lim.max_chars:
                lim.size(int(m[:13]), what)


def _guard_binop(lim: _Limits, op: str, a: Any, b: Any) -> None:
    lim.tick()
    if op == "*":
        for seq, n in ((a, b), (b, a)):
            if _length(seq) and _is_int(n):
                lim.size(_length(seq) * max(n, 0), "a repeated value")
        if _is_int(a) and _is_int(b):
            lim.size(a.bit_length() + b.bit_length(), "an integer product (bits)", _MAX_INT_BITS)
    elif op == "**":
        if _is_int(a) and _is_int(b) and abs(a) > 1:
            lim.size(b * a.bit_length(), "an integer power (bits)", _MAX_INT_BITS)
    elif op == "+":
        lim.size(_length(a) + _length(b), "a concatenation")
    elif op == "%":
        _check_format(lim, a, "a formatted string width")
        _check_widths(lim, b if isinstance(b, tuple) else (b,), "a formatted string width")
        _check_values(lim, (a, b), "a formatted string")


def _joined_size(lim: _Limits, items: list, sep: Any) -> int:
    return sum(_deep_len(i, lim.max_chars) for i in items) + _length(sep) * len(items)


def _guard_call(lim: _Limits, obj: Any, args: tuple, kwargs: dict) -> tuple:
    """Before a template calls a function or method; returns the arguments to call it with (an iterable
    given to str.join is read once, here)."""
    lim.tick()
    _check_values(lim, (*args, *kwargs.values()), "a call argument")
    receiver = getattr(obj, "__self__", None)
    if not isinstance(receiver, str):
        return args
    name = getattr(obj, "__name__", "")
    _check_widths(lim, (*args, *kwargs.values()), "a call argument")
    if name == "expandtabs":
        lim.size(len(receiver) * (args[0] if args and _is_int(args[0]) else 8), "a string")
    elif name == "replace" and len(args) >= 2:
        lim.size((len(receiver) + 1) * max(_length(args[1]), 1), "a string")
    elif name == "join" and args:
        items = list(args[0])
        lim.size(_joined_size(lim, items, receiver), "a string")
        args = (items, *args[1:])
    return args


# filters that only count, pick or reorder: their arguments are not turned into text
_PICKING_FILTERS = frozenset(
    (
        "length",
        "count",
        "first",
        "last",
        "list",
        "reverse",
        "select",
        "reject",
        "selectattr",
        "rejectattr",
        "map",
        "sort",
        "unique",
        "min",
        "max",
        "batch",
        "slice",
        "groupby",
        "dictsort",
        "items",
        "attr",
        "default",
        "d",
        "int",
        "float",
        "abs",
        "round",
        "bool",
    )
)


def _guarded_filter(name: str, f):
    pass_arg = getattr(f, "jinja_pass_arg", None)

    def filter_(*args, **kwargs):
        lim = _limits.get()
        head, (value, *rest) = (args[:1], args[1:]) if pass_arg else ((), args)
        lim.tick()
        _check_widths(lim, (*rest, *kwargs.values()), "a filter argument")
        if name not in _PICKING_FILTERS:
            _check_values(lim, (value, *rest, *kwargs.values()), "a filter argument")
        if name == "format":
            _check_format(lim, value, "a formatted string width")
        elif name == "replace" and len(rest) >= 2:
            lim.size((_deep_len(value, lim.max_chars) + 1) * max(_length(rest[1]), 1), "a string")
        elif name == "indent" and rest and isinstance(rest[0], str):
            lim.size(_length(value) + str(value).count("\n") * len(rest[0]), "a string")
        elif name == "join":
            value = list(value)
            lim.size(_joined_size(lim, value, rest[0] if rest else kwargs.get("d", "")), "a string")
        out = f(*head, value, *rest, **kwargs)
        lim.size(_length(out), "a filter result")
        return out

    filter_.__name__ = f.__name__
    if pass_arg is not None:
        filter_.jinja_pass_arg = pass_arg
    return filter_


def _join(parts: Iterable[Any]) -> str:
    """`~` (Concat), its size checked before the strings are made."""
    lim = _limits.get()
    parts = tuple(parts)
    _check_values(lim, parts, "a concatenation")
    return "".join(map(str, parts))


def _finalize(value: Any) -> Any:
    """Every `{{ value }}` before it becomes text."""
    lim = _limits.get()
    lim.size(_deep_len(value, lim.max_chars), "an output value")
    return value


def _render_limited(compiled, variables: dict, seconds: float, max_chars: int) -> str:
    """compiled.render(**variables) within `seconds` and `max_chars` of output, or one KestrelError."""
    lim = _Limits(seconds, max_chars)
    token = _limits.set(lim)
    state = {"done": False, "fired": False}
    lock = threading.Lock()
    tid = threading.get_ident()

    def interrupt():  # loops that call nothing and write nothing: raise in the rendering thread
        with lock:
            if not state["done"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(
                    ctypes.c_ulong(tid), ctypes.py_object(_TemplateTimeout)
                )

    watchdog = threading.Timer(seconds, interrupt)
    watchdog.daemon = True
    try:
        try:
            watchdog.start()
            pieces, n = [], 0
            for piece in compiled.generate(**variables):
                n += len(piece)
                lim.size(n, "output")
                pieces.append(piece)
            return "".join(pieces)
        finally:
            watchdog.cancel()
            with lock:
                state["done"] = True
                if state["fired"]:  # not delivered yet: withdraw it
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)
            _limits.reset(token)
    except _TemplateTimeout:
        raise KestrelError(f"chat template error: rendering took more than {seconds:g} s") from None


def _compile_template(source: str):
    """The compiled template, or KestrelError("invalid chat template: <one line>"). Compiled once per source: the
    template and the failure are both cached."""
    compiled = _template_cache.get(source)
    if compiled is None:
        compiled = _template_cache[source] = _compile_in_thread(source)
    if isinstance(compiled, KestrelError):
        raise KestrelError(
            str(compiled)
        )  # a new exception each time: no traceback piles up on the cached one
    return compiled


def _compile_in_thread(source: str):
    """_build_template(source), or the KestrelError it fails with. Jinja's parser and code generator recurse once
    per level of nesting in the template (~80 nested parentheses exhaust Python's recursion limit); a new thread
    starts with an empty stack, so whether a template compiles does not depend on where it is first used."""
    result: list = []

    def work():
        try:
            result.append(_build_template(source))
        except RecursionError:
            result.append(
                KestrelError("invalid chat template: nested too deeply (Python's recursion limit)")
            )
        except MemoryError:
            result.append(KestrelError("invalid chat template: out of memory while compiling it"))
        except (
            Exception
        ) as e:  # jinja2.TemplateSyntaxError; SyntaxError from Python's compiler; anything else
            result.append(KestrelError(f"invalid chat template: {_one_line(e)}"))

    t = threading.Thread(target=work, name="kestrel-template-compile", daemon=True)
    t.start()
    t.join()
    return result[0] if result else KestrelError("invalid chat template: compiling it failed")


def _build_template(source: str):
    import jinja2
    import jinja2.ext
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class LimitedCodeGenerator(CodeGenerator):
        def visit_Concat(self, node, frame):  # `a ~ b`: through _join, which checks the size first
            self.write("environment.kestrel_join((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class _LimitedEnvironment(ImmutableSandboxedEnvironment):
        code_generator_class = LimitedCodeGenerator
        intercepted_binops = frozenset(("*", "**", "+", "%"))
        kestrel_join = staticmethod(_join)

        def call_binop(self, context, operator, left, right):
            _guard_binop(_limits.get(), operator, left, right)
            return super().call_binop(context, operator, left, right)

        def wrap_str_format(self, value):  # s.format(...) and s.format_map(...) bypass `call`
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None

            def checked(*args, **kwargs):
                lim = _limits.get()
                _check_format(lim, value.__self__, "a formatted string width")
                mapping = args[0].values() if args and isinstance(args[0], dict) else ()
                _check_widths(lim, (*args, *kwargs.values(), *mapping), "a formatted string width")
                _check_values(lim, (*args, *kwargs.values()), "a formatted string")
                return wrapped(*args, **kwargs)

            return checked

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
            args = _guard_call(_limits.get(), __obj, args, kwargs)
            out = super().call(__context, __obj, *args, **kwargs)
            _limits.get().size(_length(out), "a call result")
            return out

    def raise_exception(message):
        raise KestrelError(f"chat template error: {message}")

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"namespace attribute {name!r} is not allowed"
                )

    class GenerationTag(jinja2.ext.Extension):
        # transformers' `{% generation %}...{% endgeneration %}` block (assistant-token masks); it renders its body.
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(
                lineno
            )

        def _render(self, caller):
            return caller()

    env = _LimitedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
        finalize=_finalize,
    )
    env.filters["tojson"] = tojson
    env.filters = {name: _guarded_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """A copy made only of plain JSON-like types (what transformers' `_plain_template_data` does)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        try:
            return _plain(value.item())
        except Exception:
            pass
    return f"<{type(value).__name__}>"


def _check_depth(value: Any, what: str) -> None:
    """KestrelError when `value` nests lists/dicts more than TEMPLATE_MAX_DEPTH levels (a cycle does)."""
    from kestrel_cli.text.constrained import too_deep

    if too_deep(value, TEMPLATE_MAX_DEPTH):
        raise KestrelError(
            f"chat template error: {what} is nested more than {TEMPLATE_MAX_DEPTH} levels deep"
        )


def _normalize_messages(messages: Iterable[Any]) -> list[dict]:
    out = []
    for i, message in enumerate(messages):
        if not isinstance(
            message, Mapping
        ):  # its type, not its repr: that can be huge, or recurse without end
            raise KestrelError(
                f"chat messages must be dicts, got {type(message).__name__} at messages[{i}]"
            )
        _check_depth(message, f"messages[{i}]")
        message = {k: v for k, v in message.items() if v is not None}
        reasoning = next(
            (message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None
        )
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(_plain(message))
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Tokenizer
# ---------------------------------------------------------------------------------------------------------------------


class Tokenizer:
    """Text <-> ids for one model. Build with `Tokenizer.from_dir` or `Tokenizer.from_gguf`."""

    def __init__(
        self,
        backend: _Backend,
        *,
        chat_template: str | dict[str, str] | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        unk_token: str | None = None,
        pad_token: str | None = None,
        eos_token_ids: Iterable[int] = (),
        add_bos_token: bool | None = None,
        add_eos_token: bool | None = None,
    ):
        self._backend = backend
        self._longest_token: int | None = (
            None  # characters of the longest vocabulary entry (max_text_chars)
        )
        # A dict of named templates ({"default": ..., "tool_use": ...}) or one template, as transformers keeps it.
        self._chat_templates = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.unk_token = unk_token
        self.pad_token = pad_token
        self.bos_token_id = self._id_of(bos_token)
        self.eos_token_id = self._id_of(eos_token)
        self.unk_token_id = self._id_of(unk_token)
        self.pad_token_id = self._id_of(pad_token)

        if add_bos_token is not None or add_eos_token is not None or backend.post_processor is None:
            # Like transformers: explicit add_bos_token/add_eos_token flags replace the post-processor.
            self._set_post_processor(bool(add_bos_token), bool(add_eos_token))
        probe = backend.encode("", add_special_tokens=True).ids
        self.add_bos_token = self.bos_token_id is not None and probe[:1] == [self.bos_token_id]
        self.add_eos_token = self.eos_token_id is not None and probe[-1:] == [self.eos_token_id]

        ids = set(int(i) for i in eos_token_ids)
        if self.eos_token_id is not None:
            ids.add(self.eos_token_id)
        self.eos_token_ids: set[int] = ids

    # -- construction -------------------------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str | os.PathLike) -> "Tokenizer":
        """Load a Hugging Face checkpoint directory (tokenizer.json + tokenizer_config.json + ...)."""
        root = Path(path)
        if not root.is_dir():
            raise KestrelError(f"{root}: not a directory")
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise KestrelError(
                f"{tok_file}: tokenizer.json not found (a Hugging Face tokenizer is required)"
            )
        try:
            backend = _Backend.from_file(str(tok_file))
        except Exception as e:  # the Rust side raises plain Exception
            raise KestrelError(f"{tok_file}: corrupt tokenizer.json ({_one_line(e)})") from None

        config = _read_json(root / "tokenizer_config.json")
        gen_config = _read_json(root / "generation_config.json")
        model_config = _read_json(root / "config.json")

        # Named special tokens: strings, or serialised AddedTokens ({"content": ...}).
        special = {
            name: _token_content(config.get(name))
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
        }
        # Like transformers, named special tokens missing from the vocabulary's added tokens become special tokens.
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        missing = [s for s in special.values() if s is not None and s not in added]
        if missing:
            backend.add_special_tokens(
                [AddedToken(s, special=True, normalized=False) for s in missing]
            )

        # Chat templates: chat_template.jinja (+ additional_chat_templates/*.jinja) win over tokenizer_config.json.
        templates: dict[str, str] = {}
        raw = config.get("chat_template")
        if isinstance(raw, str):
            templates["default"] = raw
        elif isinstance(raw, list):
            for entry in raw:
                if isinstance(entry, Mapping) and "name" in entry and "template" in entry:
                    templates[str(entry["name"])] = entry["template"]
        elif isinstance(raw, Mapping):
            templates.update({str(k): v for k, v in raw.items() if isinstance(v, str)})
        from_files: dict[str, str] = {}
        jinja_file = root / "chat_template.jinja"
        if jinja_file.is_file():
            from_files["default"] = _read_text(jinja_file)
        extra_dir = root / "additional_chat_templates"
        if extra_dir.is_dir():
            for f in sorted(extra_dir.glob("*.jinja")):
                from_files[f.stem] = _read_text(f)
        if (
            from_files
        ):  # as in transformers, template files replace tokenizer_config.json's templates entirely
            templates = from_files
        chat_template = _collapse_templates(templates)

        # BOS/EOS for add_special_tokens=True: tokenizer.json's post-processor decides, as in transformers 5 (which
        # drops tokenizer_config's add_bos_token/add_eos_token when there is a tokenizer.json). Only when
        # tokenizer.json has no post-processor do we honour those flags (transformers 5 then adds nothing; 4.x did).
        flags: dict[str, bool | None] = {"add_bos_token": None, "add_eos_token": None}
        if backend.post_processor is None:
            flags = {k: bool(config[k]) if k in config else None for k in flags}
        tok = cls(backend, chat_template=chat_template, eos_token_ids=(), **flags, **special)
        # Stop ids: the tokenizer's eos token plus generation_config.json's eos_token_id (int or list), plus
        # config.json's.
        for cfg in (gen_config, model_config):
            tok.eos_token_ids.update(_int_ids(cfg.get("eos_token_id")))
        return tok

    @classmethod
    def from_gguf(cls, reader: Any) -> "Tokenizer":
        """Build from the tokenizer metadata of a `gguf.GGUFReader` (or a path to a .gguf file)."""
        if isinstance(reader, (str, os.PathLike)):
            try:
                from gguf import GGUFReader

                reader = GGUFReader(os.fspath(reader))
            except Exception as e:
                raise KestrelError(f"{reader}: cannot read GGUF file ({_one_line(e)})") from None
        fields = reader.fields

        def get(key, default=None):
            field = fields.get(key)
            if field is None:
                return default
            try:
                return field.contents()
            except Exception as e:
                raise KestrelError(f"GGUF metadata {key}: unreadable ({_one_line(e)})") from None

        model = get("tokenizer.ggml.model")
        if model is None:
            raise KestrelError("GGUF file has no tokenizer (tokenizer.ggml.model missing)")
        tokens = get("tokenizer.ggml.tokens")
        if not tokens:
            raise KestrelError(
                "GGUF file has no tokenizer vocabulary (tokenizer.ggml.tokens missing)"
            )
        n = len(tokens)
        token_types = get("tokenizer.ggml.token_type") or [1] * n
        if len(token_types) != n:
            raise KestrelError(
                "GGUF tokenizer.ggml.token_type does not match tokenizer.ggml.tokens"
            )
        merges = get("tokenizer.ggml.merges")
        architecture = get("general.architecture", "")

        def token_at(key):
            i = get(key)
            if i is None:
                return None, None
            i = int(i)
            if not 0 <= i < n:
                raise KestrelError(f"GGUF {key}={i} is outside the vocabulary of {n} tokens")
            return i, tokens[i]

        bos_id, bos = token_at("tokenizer.ggml.bos_token_id")
        eos_id, eos = token_at("tokenizer.ggml.eos_token_id")
        unk_id, unk = token_at("tokenizer.ggml.unknown_token_id")
        pad_id, pad = token_at("tokenizer.ggml.padding_token_id")

        if model == "gpt2":
            backend = _byte_level_from_gguf(tokens, token_types, merges, get("tokenizer.ggml.pre"))
            default_add_bos = None
        elif model == "llama":
            if architecture in _UNSUPPORTED_SPM_ARCHS:
                raise KestrelError(
                    f"GGUF tokenizer: SentencePiece vocabulary of architecture {architecture!r} is not supported"
                )
            backend = _sentencepiece_from_gguf(
                tokens,
                token_types,
                merges,
                get("tokenizer.ggml.scores"),
                get("tokenizer.ggml.add_space_prefix", True),
            )
            # Older files have no flag; llama.cpp (and transformers) add BOS to a SentencePiece vocabulary then.
            default_add_bos = True
        else:
            raise KestrelError(
                f"GGUF tokenizer model {model!r} is not supported (supported: 'gpt2' byte-level BPE, "
                "'llama' SentencePiece BPE)"
            )

        # Control tokens -> special added tokens; user-defined tokens -> plain added tokens (matched whole).
        control = [t for t, ty in zip(tokens, token_types) if ty == _TOKEN_TYPE_CONTROL]
        named = [t for t in (bos, eos, unk, pad) if t is not None and t not in control]
        specials = list(dict.fromkeys(control + named))
        if specials:
            backend.add_special_tokens(
                [AddedToken(t, special=True, normalized=False) for t in specials]
            )
        user = [t for t, ty in zip(tokens, token_types) if ty == _TOKEN_TYPE_USER_DEFINED]
        if user:
            backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user])

        templates: dict[str, str] = {}
        main = get("tokenizer.chat_template")
        if main:
            templates["default"] = main
        for name in get("tokenizer.chat_templates") or ():
            t = get(f"tokenizer.chat_template.{name}")
            if t:
                templates[name] = t
        chat_template = _collapse_templates(templates)

        add_bos = get("tokenizer.ggml.add_bos_token", default_add_bos)
        add_eos = get("tokenizer.ggml.add_eos_token")

        stop = set()
        for key in (
            "tokenizer.ggml.eos_token_id",
            "tokenizer.ggml.eot_token_id",
            "tokenizer.ggml.eom_token_id",
        ):
            i = get(key)
            if i is not None and 0 <= int(i) < n:
                stop.add(int(i))
        stop.update(
            i
            for i, (t, ty) in enumerate(zip(tokens, token_types))
            if ty == _TOKEN_TYPE_CONTROL and t in _EOG_TEXTS
        )

        tok = cls(
            backend,
            chat_template=chat_template,
            bos_token=bos,
            eos_token=eos,
            unk_token=unk,
            pad_token=pad,
            eos_token_ids=stop,
            add_bos_token=None if add_bos is None else bool(add_bos),
            add_eos_token=None if add_eos is None else bool(add_eos),
        )
        # The GGUF's own ids win over a lookup by text (duplicate spellings in a vocabulary are possible).
        tok.bos_token_id, tok.eos_token_id, tok.unk_token_id, tok.pad_token_id = (
            bos_id,
            eos_id,
            unk_id,
            pad_id,
        )
        return tok

    # -- encoding / decoding ------------------------------------------------------------------------------------------

    def encode(
        self, text: str, add_special_tokens: bool = False, limit: int | None = None
    ) -> list[int]:
        """Token ids of `text`. Special tokens written in the text are recognised. `add_special_tokens` adds BOS
        (and EOS) when the model asks for it. With `limit`, a text of more than `limit` tokens raises
        TooManyTokens, and a text far longer than that is refused after tokenising about `limit` tokens of it
        (`_count_upto`), not the whole: a megabyte prompt for a 4K context costs what a 4K prompt does."""
        if not isinstance(text, str):
            raise KestrelError(f"encode expects a string, got {type(text).__name__}")
        if not text.isascii():
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as e:  # a lone surrogate: the tokenizer would raise TypeError
                raise KestrelError(
                    f"text is not valid Unicode (a lone surrogate at character {e.start})"
                ) from None
        if limit is not None and len(text) > 2 * limit + COUNT_CHUNK_CHARS:
            self._count_upto(text, limit)
        # encode_batch lets go of the GIL while it works (encode does not): a long prompt tokenised in a
        # worker thread leaves the server's event loop running
        ids = self._backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if limit is not None and len(ids) > limit:
            raise TooManyTokens(len(ids), limit, exact=True)
        return ids

    def _count_upto(self, text: str, limit: int) -> None:
        """Raise TooManyTokens once `text`, tokenised in pieces of about COUNT_CHUNK_CHARS characters, has
        clearly more than `limit` tokens; return when it may fit. Each piece ends before a whitespace
        character where one is near (where byte-level and SentencePiece pre-tokenizers split anyway); a cut
        elsewhere can add a few tokens the whole text would not have (merges across it lost, a dummy prefix),
        so the count must pass `limit` by COUNT_CUT_SLACK tokens a cut before the text is refused: a refused
        text is too long for certain, and one that may fit is tokenised whole by `encode`."""
        n, start, cuts = 0, 0, 0
        while start < len(text):
            end = min(start + COUNT_CHUNK_CHARS, len(text))
            if end < len(text):
                back = max(start + 1, end - 1024)
                ws = max(text.rfind(" ", back, end), text.rfind("\n", back, end))
                end = ws if ws > start else end
            n += len(self._backend.encode_batch([text[start:end]], add_special_tokens=False)[0].ids)
            cuts += start > 0
            if n - cuts * COUNT_CUT_SLACK > limit:
                raise TooManyTokens(n - cuts * COUNT_CUT_SLACK, limit, exact=False)
            start = end

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        size = self.vocab_size
        for i in ids:
            if not 0 <= i < size:
                raise KestrelError(f"token id {i} is outside the vocabulary of {size} tokens")
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def detokenizer(self, skip_special_tokens: bool = False) -> "Detokenizer":
        return Detokenizer(self, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(int(token_id))

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (transformers' `len(tokenizer)`)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def __len__(self) -> int:
        return self.vocab_size

    @property
    def id_limit(self) -> int:
        """One more than the largest id the tokenizer can produce (added tokens included)."""
        return max(self._backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1

    def max_text_chars(self, n_tokens: int) -> int:
        """More characters than any text of `n_tokens` tokens has: lets a caller refuse a text too long for a
        context before paying for its tokenisation. A token stands for at most as many characters as its
        vocabulary entry has (byte-level and SentencePiece spellings are never shorter than the text); x4
        covers normalizers that merge characters (NFC composes at most a few into one)."""
        if self._longest_token is None:
            self._longest_token = max(
                map(len, self._backend.get_vocab(with_added_tokens=True)), default=1
            )
        return 4 * n_tokens * self._longest_token

    @property
    def backend(self) -> _Backend:
        return self._backend

    # -- chat templates -----------------------------------------------------------------------------------------------

    @property
    def chat_template(self) -> str | None:
        """The default chat template (None when the model has none)."""
        t = self._chat_templates
        if isinstance(t, dict):
            return t.get("default")
        return t

    @property
    def chat_templates(self) -> dict[str, str]:
        t = self._chat_templates
        if t is None:
            return {}
        return dict(t) if isinstance(t, dict) else {"default": t}

    def chat_template_error(self) -> str | None:
        """Why the model's chat templates do not compile ("invalid chat template: ...", naming the template when
        there are several), or None when they do or there is none. Compiled once: rendering reuses the result."""
        for name, source in self.chat_templates.items():
            try:
                _compile_template(source)
            except KestrelError as e:
                return str(e) if len(self.chat_templates) == 1 else f"{name}: {e}"
        return None

    def _pick_template(self, tools, override: str | None = None) -> str:
        t = self._chat_templates
        if override is not None:
            # As in transformers: the name of one of the model's templates, or a template's source.
            return t[override] if isinstance(t, dict) and override in t else override
        if isinstance(t, dict):
            if tools is not None and "tool_use" in t:
                return t["tool_use"]
            if "default" in t:
                return t["default"]
            raise KestrelError(
                f"model has several chat templates and none is the default: {sorted(t)}"
            )
        if not t:
            raise KestrelError(NO_TEMPLATE_MESSAGE)
        return t

    def apply_chat_template(
        self,
        messages: Iterable[Mapping[str, Any]],
        add_generation_prompt: bool = True,
        tokenize: bool = False,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        max_chars: int = TEMPLATE_MAX_CHARS,
        **kwargs: Any,
    ) -> str | list[int]:
        """Render `messages` with the model's chat template, as transformers does; extra keyword arguments reach
        the template (e.g. `enable_thinking=False`). With `tokenize=True`, returns the ids of the rendered text
        (encoded with add_special_tokens=False: the template writes BOS itself when it wants one).
        `chat_template` picks one of the model's named templates, or replaces the template with the given source.
        Rendering stops with a KestrelError past TEMPLATE_SECONDS or past `max_chars` characters of output."""
        template = self._pick_template(tools, chat_template)
        compiled = _compile_template(template)
        variables: dict[str, Any] = {
            name: value
            for name, value in (
                ("bos_token", self.bos_token),
                ("eos_token", self.eos_token),
                ("unk_token", self.unk_token),
                ("pad_token", self.pad_token),
            )
            if value is not None
        }
        # before _plain copies them (it recurses once per level)
        for name, value in kwargs.items():
            _check_depth(value, name)
        for name, items in (("tools", tools), ("documents", documents)):
            for i, item in enumerate(items if isinstance(items, (list, tuple)) else [items]):
                _check_depth(item, f"{name}[{i}]")
        variables.update(_plain(kwargs))
        variables.update(
            messages=_normalize_messages(messages),
            tools=_plain(tools),
            documents=_plain(documents),
            add_generation_prompt=add_generation_prompt,
        )
        try:
            text = _render_limited(compiled, variables, TEMPLATE_SECONDS, max_chars)
        except KestrelError:
            raise
        except Exception as e:  # jinja2.TemplateError, or Python's own (1/0, int('x'), ...)
            raise KestrelError(f"chat template error: {_one_line(e)}") from None
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    # -- internals ----------------------------------------------------------------------------------------------------

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)

    def _set_post_processor(self, add_bos: bool, add_eos: bool) -> None:
        bos, eos = self.bos_token, self.eos_token
        add_bos = add_bos and bos is not None and self.bos_token_id is not None
        add_eos = add_eos and eos is not None and self.eos_token_id is not None
        single = (f"{bos}:0 " if add_bos else "") + "$A:0" + (f" {eos}:0" if add_eos else "")
        pair = (
            single + (f" {bos}:1" if add_bos else "") + " $B:1" + (f" {eos}:1" if add_eos else "")
        )
        special = []
        if add_bos:
            special.append((bos, self.bos_token_id))
        if add_eos and eos != bos:
            special.append((eos, self.eos_token_id))
        self._backend.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=special
        )


# ---------------------------------------------------------------------------------------------------------------------
# Streaming detokenizer
# ---------------------------------------------------------------------------------------------------------------------


class Detokenizer:
    """Incremental ids -> text: `tokenizers.decoders.DecodeStream`, plus `flush` for the end of a stream.

    DecodeStream decodes a window of recent ids in context (so SentencePiece's "▁world" gets its space and the
    bytes of one UTF-8 character can come from several tokens) and returns None while the text ends in an
    incomplete character (U+FFFD). `add` returns "" then. `flush` gives what is still held back at the end of a
    stream: the same window decoded once more, an incomplete character becoming U+FFFD.

    The concatenation of everything `add` and `flush` return equals `tokenizer.decode(all_ids)`. (One exception, for
    invalid UTF-8 only: SentencePiece's ByteFallback decoder turns a whole run of byte tokens that is not valid
    UTF-8 into U+FFFD, valid bytes included, whereas the stream has already emitted the valid ones.)
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = False):
        self._backend = tokenizer.backend
        self._skip = skip_special_tokens
        self.reset()

    def reset(self) -> None:
        self._stream = decoders.DecodeStream(skip_special_tokens=self._skip)
        # For flush only: the ids of the last emitted chunk (decoding context) and those held back since.
        self._last: list[int] = []
        self._held: list[int] = []

    def add(self, token_id: int) -> str:
        """Feed one id; return the text it completes ("" while a character is still incomplete)."""
        token_id = int(token_id)
        self._held.append(token_id)
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception as e:  # the Rust side raises plain Exception
            if "invalid prefix" not in str(e).lower():
                raise KestrelError(f"cannot decode token {token_id}: {_one_line(e)}") from None
            # Invalid UTF-8 made ByteFallback rewrite text already emitted: start a new stream at the held ids.
            held, self._held = self._held, []
            self._stream = decoders.DecodeStream(skip_special_tokens=self._skip)
            return "".join(self.add(i) for i in held)
        if text is None:
            return ""
        self._last, self._held = self._held, []
        return text

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end decodes to U+FFFD here)."""
        out = ""
        if self._held:
            before = self._decode(self._last)
            text = self._decode(self._last + self._held)
            out = text[len(before) :] if text.startswith(before) else self._decode(self._held)
        self.reset()
        return out

    def _decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)


# ---------------------------------------------------------------------------------------------------------------------
# GGUF vocabularies -> tokenizers backends
# ---------------------------------------------------------------------------------------------------------------------


def _split_merges(merges) -> list[tuple[str, str]]:
    out = []
    for m in merges:
        parts = m.split(" ")
        if len(parts) != 2:
            raise KestrelError(f"GGUF tokenizer.ggml.merges: malformed merge {m!r}")
        out.append((parts[0], parts[1]))
    return out


def _byte_level_from_gguf(tokens, token_types, merges, pre) -> _Backend:
    if merges is None:
        raise KestrelError("GGUF byte-level BPE tokenizer has no tokenizer.ggml.merges")
    spelling = _bytes_to_unicode()
    alphabet = set(spelling.values())
    vocab: dict[str, int] = {}
    for i, (t, ty) in enumerate(zip(tokens, token_types)):
        if ty in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED) or set(t) <= alphabet:
            key = t  # added tokens are stored as raw text (llama.cpp), normal tokens in the byte alphabet
        else:
            key = "".join(spelling[b] for b in t.encode("utf-8"))
        vocab.setdefault(key, i)
    try:
        bpe = models.BPE(
            vocab=vocab,
            merges=_split_merges(merges),
            dropout=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
        )
    except KestrelError:
        raise
    except Exception as e:
        raise KestrelError(
            f"GGUF byte-level BPE tokenizer is inconsistent ({_one_line(e)})"
        ) from None
    backend = _Backend(bpe)
    if pre in _DIGIT_SPLIT_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    elif pre in _REGEX_SPLIT_PRE:
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_REGEX_SPLIT_PRE[pre]), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:  # "gpt-2", "default" and names transformers does not know: GPT-2's regex
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    backend.decoder = decoders.ByteLevel()
    return backend


def _generate_merges(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece vocabulary: every split of a piece into two pieces, best score first
    (transformers.tokenization_utils_base.generate_merges with vocab_scores)."""
    merges = []
    for piece, score in scores.items():
        local = []
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        merges.extend(local)
    merges.sort(key=lambda v: (v[2], len(v[0]), len(v[1])), reverse=True)
    return [(a, b) for a, b, _ in merges]


def _sentencepiece_from_gguf(tokens, token_types, merges, scores, add_space_prefix) -> _Backend:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)
    if merges is not None:
        merge_list = _split_merges(merges)
    else:
        if scores is None or len(scores) != len(tokens):
            raise KestrelError("GGUF SentencePiece tokenizer has neither merges nor scores")
        merge_list = _generate_merges(vocab, dict(zip(tokens, scores)))
    try:
        bpe = models.BPE(
            vocab=vocab, merges=merge_list, fuse_unk=True, byte_fallback=True, dropout=None
        )
    except Exception as e:
        raise KestrelError(
            f"GGUF SentencePiece tokenizer is inconsistent ({_one_line(e)})"
        ) from None
    backend = _Backend(bpe)
    # transformers' LlamaTokenizer (legacy=False): Metaspace, prefix "▁" on the first piece only.
    backend.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False
    )
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_space_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    backend.decoder = decoders.Sequence(steps)
    return backend


# ---------------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------------


def _one_line(e: BaseException) -> str:
    s = str(e).strip().splitlines()
    return s[0] if s else type(e).__name__


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KestrelError(f"{path}: unreadable ({_one_line(e)})") from None


def _read_json(path: Path) -> dict:
    """The JSON object in `path`, {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(_read_text(path))
    except ValueError as e:  # JSONDecodeError, or an integer over 4300 digits
        raise KestrelError(f"{path}: corrupt {path.name} ({e})") from None
    except RecursionError:
        raise KestrelError(f"{path}: corrupt {path.name} (nested too deeply)") from None
    if not isinstance(data, dict):
        raise KestrelError(f"{path}: corrupt {path.name} (expected a JSON object)")
    return data


def _collapse_templates(templates: dict[str, str]) -> str | dict[str, str] | None:
    """None, the one template, or the dict of named templates (as transformers keeps `chat_template`)."""
    if not templates:
        return None
    if list(templates) == ["default"]:
        return templates["default"]
    return templates


def _token_content(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _int_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []
