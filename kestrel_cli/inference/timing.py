"""The timing lines on stderr: format, parse, and print them (rich on a terminal); the
contract is docs/DESIGN.md §4 Timing lines.

    [DEC-SINGLE] tok=12 pos=2073 ms=56.2 attn=12.8 matmul=40.1 other=3.3
    [PERF] prefill_tokens=2061 prefill_ms=... prefill_tps=... decode_tokens=... decode_ms=...
           decode_tps=... attn_ms_per_tok=... kv_bytes=...
           [vision_ms=... image_tokens=... vision_bits=...]
           [draft_tokens=... draft_accepted=... draft_rate=...]

Keys and their order are stable for scripts (scripts/*.sh parse them with awk). Times are
milliseconds with one decimal, rates tokens/second with one decimal, counts integers.
`chat` adds a `[TURN]` line per answer (prompt cache reuse); it is not part of the contract.
"""

from __future__ import annotations

import io
import os
import re
import sys
from typing import TextIO

from kestrel_cli.inference.generate import Stats, TokenTiming

DEC_KEYS = ("tok", "pos", "ms", "attn", "matmul", "other")
PERF_KEYS = (
    "prefill_tokens",
    "prefill_ms",
    "prefill_tps",
    "decode_tokens",
    "decode_ms",
    "decode_tps",
    "attn_ms_per_tok",
    "kv_bytes",
)
# appended to [PERF] when the prompt had images (Qwen3-VL): vision tower time (part of
# prefill_ms), the prompt's image tokens, and the width of the tower's matmul and attention
# operands: 16 (bf16, --vision-dtype) or 32 (float32)
PERF_VISION_KEYS = ("vision_ms", "image_tokens", "vision_bits")
# appended to [PERF] when a draft model ran (--draft): tokens it proposed, how many of them
# the target accepted, and that as a percentage
PERF_DRAFT_KEYS = ("draft_tokens", "draft_accepted", "draft_rate")
TURN_KEYS = (
    "turn",
    "prompt_tokens",
    "cached",
    "prefill_tokens",
    "generated_tokens",
    "ctx_used",
    "ctx_size",
)

_LINE = re.compile(r"^\[([A-Z][A-Z0-9_-]*)\]((?: [a-z_]+=[^ ]+)*)\s*$")


def _fmt(key: str, value) -> str:
    if isinstance(value, float):
        return f"{key}={value:.1f}"
    return f"{key}={value}"


def format_line(tag: str, pairs: dict) -> str:
    return f"[{tag}] " + " ".join(_fmt(k, v) for k, v in pairs.items())


def format_dec(t: TokenTiming) -> str:
    """One [DEC-SINGLE] line for a decoded token."""
    return format_line(
        "DEC-SINGLE",
        dict(
            tok=int(t.tok),
            pos=int(t.pos),
            ms=float(t.ms),
            attn=float(t.attn),
            matmul=float(t.matmul),
            other=float(t.other),
        ),
    )


def format_perf(s: Stats) -> str:
    """The [PERF] summary of one generation."""
    return format_line(
        "PERF",
        dict(
            prefill_tokens=int(s.prefill_tokens),
            prefill_ms=float(s.prefill_ms),
            prefill_tps=float(s.prefill_tps),
            decode_tokens=int(s.decode_tokens),
            decode_ms=float(s.decode_ms),
            decode_tps=float(s.decode_tps),
            attn_ms_per_tok=float(s.attn_ms_per_tok),
            kv_bytes=int(s.kv_bytes),
            **(
                dict(
                    vision_ms=float(s.vision_ms),
                    image_tokens=int(s.image_tokens),
                    vision_bits=int(s.vision_bits),
                )
                if s.image_tokens
                else {}
            ),
            **(
                dict(
                    draft_tokens=int(s.draft_tokens),
                    draft_accepted=int(s.draft_accepted),
                    draft_rate=float(s.draft_rate),
                )
                if s.draft_tokens
                else {}
            ),
        ),
    )


def format_turn(turn: int, s: Stats, ctx_used: int, ctx_size: int) -> str:
    """chat's per-turn summary: how much of the prompt came from the KV cache."""
    return format_line(
        "TURN",
        dict(
            turn=turn,
            prompt_tokens=s.prompt_tokens,
            cached=s.cached_tokens,
            prefill_tokens=s.prefill_tokens,
            generated_tokens=s.generated_tokens,
            ctx_used=ctx_used,
            ctx_size=ctx_size,
        ),
    )


def parse_line(line: str) -> tuple[str, dict[str, int | float]] | None:
    """'[TAG] k=v ...' -> (TAG, {k: int or float}); None for any other line."""
    m = _LINE.match(line.strip())
    if not m:
        return None
    out: dict[str, int | float] = {}
    for pair in m.group(2).split():
        k, v = pair.split("=", 1)
        try:
            out[k] = int(v)
        except ValueError:
            try:
                out[k] = float(v)
            except ValueError:
                return None
    return m.group(1), out


def parse_lines(text: str, tag: str) -> list[dict[str, int | float]]:
    """Every `[tag]` line of `text` (e.g. a captured stderr), parsed, in order."""
    found = []
    for line in text.splitlines():
        p = parse_line(line)
        if p and p[0] == tag:
            found.append(p[1])
    return found


_STYLES = {"DEC-SINGLE": "dim", "PERF": "bold cyan", "TURN": "cyan"}


class TimingPrinter:
    """Writes timing lines to stderr: plain (flushed per line) when stderr is not a terminal,
    rich-styled when it is. The answer's text goes through `text` so that the per-token lines
    never cut through it: when stdout is the same terminal they are held back until the reply
    ends (`flush`); when stdout and stderr are the same file or pipe (`2>&1 | tee log`) they
    are held to the answer's line boundaries (written after each newline of the answer,
    one line per token as always).
    """

    def __init__(
        self,
        enabled: bool = True,
        stream: TextIO | None = None,
        out: TextIO | None = None,
        shared: bool | None = None,
    ):
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.out = out if out is not None else sys.stdout
        self.tty = _isatty(self.stream)
        self.defer = self.tty and _isatty(self.out)
        # one file or pipe behind both: hold the lines to the answer's line boundaries
        self.shared = (
            not self.defer and _same_file(self.stream, self.out) if shared is None else shared
        )
        self._midline = False  # the answer's last character was not a newline
        self._held: list[str] = []
        self._console = None
        if enabled and self.tty:
            from rich.console import Console

            self._console = Console(file=self.stream, highlight=False, soft_wrap=True)

    def _write(self, line: str) -> None:
        if self._console is not None:
            tag = line[1 : line.index("]")]
            self._console.print(line, style=_STYLES.get(tag, ""), markup=False)
        else:
            self.stream.write(line + "\n")
            self.stream.flush()

    def text(self, text: str, out: TextIO | None = None) -> None:
        """Write (and flush) answer text to stdout; held lines go out at its last newline."""
        if not text:
            return
        out = out if out is not None else self.out
        if self.shared and self._held and "\n" in text:
            cut = text.rindex("\n") + 1
            out.write(text[:cut])
            out.flush()
            self._midline = False
            self.flush()
            text = text[cut:]
            if not text:
                return
        out.write(text)
        out.flush()
        self._midline = not text.endswith("\n")

    def line(self, line: str, hold: bool = False) -> None:
        if not self.enabled:
            return
        if hold and (self.defer or (self.shared and self._midline)):
            self._held.append(line)
        else:
            self._write(line)

    def token(self, t: TokenTiming | None) -> None:
        if t is not None:
            self.line(format_dec(t), hold=True)

    def flush(self) -> None:
        """Write the held per-token lines (call after the reply's final newline)."""
        held, self._held = self._held, []
        for line in held:
            self._write(line)

    def perf(self, s: Stats) -> None:
        self.flush()
        self.line(format_perf(s))


def _same_file(a, b) -> bool:
    """Whether two streams write to one file, pipe or terminal."""
    try:
        sa, sb = os.fstat(a.fileno()), os.fstat(b.fileno())
    except (AttributeError, ValueError, OSError, io.UnsupportedOperation):
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def _isatty(f) -> bool:
    try:
        return f.isatty()
    except (AttributeError, ValueError):
        return False
