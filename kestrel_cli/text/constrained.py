"""Constrained decoding: answers that always parse as JSON (and match a JSON schema), with
llguidance (a maintained Rust library, on PyPI) over the model's `tokenizers` vocabulary.

A `JsonConstraint` masks the logits before each sampling step (tokens that cannot continue
a valid answer get -inf, EOS only once the JSON is complete) and follows the sampled tokens.
"""

from __future__ import annotations

import json
import weakref
from collections.abc import Mapping

import numpy as np

from kestrel_cli.core.errors import KestrelError

# LLTokenizer per Tokenizer and vocabulary size (building one takes ~1 s); weak keys: a
# cache keyed by id() handed a new tokenizer at a freed one's address the old vocabulary
_TOKENIZERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

# Levels of objects/arrays a JSON value from a user may nest (a schema, a tool's parameters, a
# tool call's arguments, chat_template_kwargs; the value itself is level 1). What reads such a
# value recurses once per level or more (json.dumps, pydantic, the chat template's data copy and
# tojson, llguidance, whose own parser stops at 128), so the limit is checked first, by too_deep,
# which does not recurse. Real schemas nest well under 20 levels.
MAX_JSON_DEPTH = 64


def too_deep(value, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `value` nests containers (mappings, lists, tuples) more than `limit` levels: {} and
    [] are 1 level, {"a": []} 2, a scalar 0. Iterative, so any depth, a cycle included, is safe to
    ask about; a container reached again at no greater depth is not walked again (shared parts)."""
    seen: dict[int, int] = {}
    stack = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, Mapping):
            children = (*v.keys(), *v.values())
        elif isinstance(v, (list, tuple)):
            children = v
        else:
            continue
        if depth > limit:
            return True
        if seen.get(id(v), 0) >= depth:
            continue
        seen[id(v)] = depth
        stack.extend(
            (c, depth + 1) for c in children if isinstance(c, (dict, list, tuple, Mapping))
        )
    return False


def check_json_depth(value, what: str, limit: int = MAX_JSON_DEPTH) -> None:
    """KestrelError naming `what` when `value` nests more than `limit` levels (see too_deep)."""
    if too_deep(value, limit):
        raise KestrelError(f"{what} is nested more than {limit} levels deep")


def _ll_error(msg) -> str:
    """llguidance's error as one short line: the message before the parser state dump and the
    grammar that follow it ("<state>...", "<grammar>..."), whitespace collapsed (a regex error
    spans lines), at most 200 characters."""
    text = str(msg).split("<state>", 1)[0].split("<grammar>", 1)[0]
    line = " ".join(text.split()) or "unknown error"
    return line if len(line) <= 200 else line[:199] + "…"


def _import():
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401
    except ImportError:
        raise KestrelError("structured output needs llguidance: pip install llguidance") from None
    return llguidance


def _ll_tokenizer(engine):
    llg = _import()
    tok = engine.tokenizer
    n_vocab = engine.config.vocab_size
    hit = _TOKENIZERS.get(tok)
    if hit is None or hit[0] != n_vocab:
        eos = sorted(tok.eos_token_ids)
        ll = llg.LLTokenizer(
            tok.backend.to_str(), n_vocab=n_vocab, eos_token=eos if len(eos) > 1 else eos[0]
        )
        hit = _TOKENIZERS[tok] = (n_vocab, ll)
    return hit[1]


class JsonConstraint:
    """Answers that are one JSON value matching `schema` ({"type": "object"}: any object)."""

    def __init__(self, engine, schema: dict | None = None, then: str = ""):
        # then: literal text the answer must end with after the JSON (a tool call's "}")
        llg = _import()
        schema = {"type": "object"} if schema is None else schema
        if not isinstance(schema, dict):
            raise KestrelError("a JSON schema must be a JSON object")
        # before json.dumps and llguidance, which recurse once per level
        check_json_depth(schema, "JSON schema not supported: the schema")
        try:
            if then:
                # a tool call's arguments with fixed separators, json.dumps' (the template's
                # tojson): flexible whitespace lets a weak model fill its tokens with blanks
                # and never close the call
                fixed = {
                    "x-guidance": {
                        "whitespace_flexible": False,
                        "item_separator": ", ",
                        "key_separator": ": ",
                    },
                    **schema,
                }
                grammar = llg.LLMatcher.grammar_from_lark(
                    f"start: value {json.dumps(then)}\nvalue: %json {json.dumps(fixed)}"
                )
            else:
                grammar = llg.LLMatcher.grammar_from_json_schema(
                    json.dumps(schema), defaults={"whitespace_flexible": False}
                )
        except (ValueError, TypeError, RecursionError) as e:  # e.g. not JSON (NaN)
            raise KestrelError(f"JSON schema not supported: {_ll_error(e)}") from None
        msg = llg.LLMatcher.validate_grammar(grammar)  # "" when it is fine
        if msg:
            raise KestrelError(f"JSON schema not supported: {_ll_error(msg)}")
        # log_level 0: llguidance's own warnings would be extra lines on stderr; its errors
        # are read with get_error() and raised here, as one line
        self.matcher = llg.LLMatcher(_ll_tokenizer(engine), grammar, log_level=0)
        if self.matcher.is_error():
            raise KestrelError(f"JSON schema not supported: {_ll_error(self.matcher.get_error())}")
        self.vocab = engine.config.vocab_size
        self.mask = llg.numpy.allocate_token_bitmask(1, self.vocab)
        self._llg = llg

    def apply(self, row: np.ndarray) -> None:
        """Set the logits of tokens the grammar does not allow next to -inf (in place)."""
        self._llg.numpy.fill_next_token_bitmask(self.matcher, self.mask, 0)
        if self.matcher.is_error():  # e.g. a pattern whose lexer grows past llguidance's limits
            raise KestrelError(f"constrained decoding: {_ll_error(self.matcher.get_error())}")
        bits = np.unpackbits(self.mask[0].view(np.uint8), bitorder="little")[: row.shape[-1]]
        row[bits == 0] = -np.inf

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise KestrelError(
                f"constrained decoding: token {token} rejected "
                f"({_ll_error(self.matcher.get_error())})"
            )

    @property
    def done(self) -> bool:
        """The answer is complete (only EOS may follow)."""
        return self.matcher.is_stopped()
