"""Constrained decoding: answers that always parse as JSON (and match a JSON schema), with
llguidance (a maintained Rust library, on PyPI) over the model's `tokenizers` vocabulary.

A `JsonConstraint` masks the logits before each sampling step (tokens that cannot continue
a valid answer get -inf, EOS only once the JSON is complete) and follows the sampled tokens.
"""
from __future__ import annotations

import json

import numpy as np

from .errors import KestrelError

_TOKENIZERS: dict[int, object] = {}      # LLTokenizer per Tokenizer (building one takes ~1 s)


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
    key = id(tok)
    if key not in _TOKENIZERS:
        eos = sorted(tok.eos_token_ids)
        _TOKENIZERS[key] = llg.LLTokenizer(tok.backend.to_str(), n_vocab=engine.config.vocab_size,
                                           eos_token=eos if len(eos) > 1 else eos[0])
    return _TOKENIZERS[key]


class JsonConstraint:
    """Answers that are one JSON value matching `schema` ({"type": "object"}: any object)."""

    def __init__(self, engine, schema: dict | None = None, then: str = ""):
        # then: literal text the answer must end with after the JSON (a tool call's "}")
        llg = _import()
        schema = {"type": "object"} if schema is None else schema
        if not isinstance(schema, dict):
            raise KestrelError("a JSON schema must be a JSON object")
        try:
            if then:
                grammar = llg.LLMatcher.grammar_from_lark(
                    f"start: value {json.dumps(then)}\nvalue: %json {json.dumps(schema)}")
            else:
                grammar = llg.LLMatcher.grammar_from_json_schema(
                    json.dumps(schema), defaults={"whitespace_flexible": False})
        except (ValueError, TypeError, RecursionError) as e:  # e.g. nested too deep
            raise KestrelError(f"JSON schema not supported: {' '.join(str(e).split())}") from None
        msg = llg.LLMatcher.validate_grammar(grammar)     # "" when it is fine
        if msg:
            raise KestrelError(f"JSON schema not supported: {' '.join(str(msg).split())}")
        self.matcher = llg.LLMatcher(_ll_tokenizer(engine), grammar)
        if self.matcher.is_error():
            raise KestrelError(f"JSON schema not supported: {self.matcher.get_error()}")
        self.vocab = engine.config.vocab_size
        self.mask = llg.numpy.allocate_token_bitmask(1, self.vocab)
        self._llg = llg

    def apply(self, row: np.ndarray) -> None:
        """Set the logits of tokens the grammar does not allow next to -inf (in place)."""
        self._llg.numpy.fill_next_token_bitmask(self.matcher, self.mask, 0)
        bits = np.unpackbits(self.mask[0].view(np.uint8), bitorder="little")[:row.shape[-1]]
        row[bits == 0] = -np.inf

    def advance(self, token: int) -> None:
        if not self.matcher.consume_token(int(token)):
            raise KestrelError(f"constrained decoding: token {token} rejected "
                               f"({self.matcher.get_error()})")

    @property
    def done(self) -> bool:
        """The answer is complete (only EOS may follow)."""
        return self.matcher.is_stopped()
