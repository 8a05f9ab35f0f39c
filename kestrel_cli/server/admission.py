"""Admission: each request is sized, and the memory it may spend taken from the server's
budget, before the work that would spend it (reading the body, rendering the chat template,
tokenising, decoding an image, compiling a grammar).

The budget counts what requests cost while they are read and prepared, on top of what the
server holds anyway (weights, KV caches): `--max-request-memory` bounds one request (over
it: 413), `--memory-budget` all of them at once (over it: 503 `server_busy` with
Retry-After; the request may be sent again a moment later). A request's lease grows as it
is sized and is given back when its reply has been sent.

The sizes are upper estimates of the peak each step reaches, measured on this code (see
docs/DESIGN.md §8): a body is held as bytes, joined, and parsed (x3); a prompt's
text is copied into the rendered template and tokenised in bounded pieces
(Tokenizer.encode's `limit`), so it costs a few bytes a character plus the ids of at most
one context; an image costs what images.decode_cost says from its header, one image
decoded at a time, plus the patches of all of them.
"""

from __future__ import annotations

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.core.osmem import physical_memory, return_freed_memory
from kestrel_cli.server.models import APIError

MiB = 1 << 20

BODY_COPIES = 3  # the body's bytes: received parts, joined, parsed
TEXT_BYTES_PER_CHAR = 16  # message copies, the rendered prompt, the piece being tokenised
TOKEN_BYTES = 64  # the ids of the prompt (Python ints, the tokenizer's Encoding)
PREP_BASE = 8 * MiB  # a request's fixed cost (template state, objects)
GRAMMAR_BYTES = 64 * MiB  # one compiled JSON schema (response_format, a forced tool)
TRIM_AFTER = 32 * MiB  # a lease this large returns freed heap pages when released


_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str, flag: str) -> int:
    """Bytes from '512M', '2G', '1.5GiB', '300mb' or a plain number of bytes (powers of 1024);
    KestrelError naming `flag` otherwise, or when not positive."""
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    unit = t[-1:] if t[-1:] in _UNITS and t[-1:] else ""
    try:
        n = float(t[:-1] if unit else t) * _UNITS[unit]
    except ValueError:
        n = float("nan")
    if not n >= 1 or n == float("inf"):
        raise KestrelError(f"{flag} must be a size such as 512M or 2G, got {text!r}")
    return int(n)


def default_budget() -> int:
    """A quarter of the RAM, at least 512 MiB (2 GiB where the OS does not say)."""
    ram = physical_memory()
    return max(512 * MiB, ram // 4) if ram else 2048 * MiB


def default_request_memory(budget: int) -> int:
    """1 GiB, or the whole budget when that is smaller."""
    return min(1024 * MiB, budget)


def prep_cost(n_chars: int, n_tokens: int, images: list = (), grammars: int = 0) -> int:
    """Bytes a request may reach while its prompt is rendered, tokenised and its images
    decoded: `n_chars` characters of text, a context of `n_tokens`, images as
    (decode_cost, patch_bytes) pairs (decoded one at a time, the patches of all kept),
    `grammars` JSON schemas compiled."""
    decode = max((d for d, _ in images), default=0)
    patches = sum(p for _, p in images)
    return (
        PREP_BASE
        + n_chars * TEXT_BYTES_PER_CHAR
        + n_tokens * TOKEN_BYTES
        + decode
        + patches
        + grammars * GRAMMAR_BYTES
    )


def _mib(n: int) -> str:
    return f"{n / MiB:.0f} MiB" if n >= MiB else f"{n} bytes"


class Budget:
    """The server's memory for requests in preparation, in bytes. Used from the event loop
    thread only (no lock)."""

    def __init__(self, total: int, per_request: int):
        self.total, self.per_request = total, min(per_request, total)
        self.used = 0

    def lease(self) -> "Lease":
        return Lease(self)


class Lease:
    """One request's share of a Budget: grows as the request is sized, never past the
    per-request limit (413) or what the budget has left (503 server_busy)."""

    def __init__(self, budget: Budget):
        self.budget, self.held = budget, 0

    def add(self, n: int, what: str) -> None:
        """Hold `n` bytes more (a lease never shrinks before release)."""
        b, total = self.budget, self.held + n
        if total > b.per_request:
            raise APIError(
                f"{what} needs about {_mib(total)} of memory to prepare, more than "
                f"the {_mib(b.per_request)} one request may use "
                f"(--max-request-memory)",
                413,
                code="request_too_large",
            )
        if b.used + n > b.total:
            raise APIError(
                f"server busy: requests in preparation hold {_mib(b.used)} of the "
                f"{_mib(b.total)} memory budget (--memory-budget); retry later",
                503,
                code="server_busy",
            )
        b.used += n
        self.held = total

    def release(self) -> None:
        """Give the share back; after a large one, the heap pages it used go back to the
        OS too, so the server's RSS returns to its idle level between bursts."""
        self.budget.used -= self.held
        if self.held >= TRIM_AFTER:
            return_freed_memory()
        self.held = 0
