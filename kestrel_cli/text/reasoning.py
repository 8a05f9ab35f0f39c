"""Structure in a chat answer's text: Qwen3's `<think>…</think>` reasoning and its
`<tool_call>{json}</tool_call>` calls, split while the text streams.

`AnswerSplitter.feed(text)` takes the detokenised pieces as they come and returns parts,
`("reasoning", text)`, `("content", text)` or `("tool_call", {"name", "arguments"})`;
`finish()` returns what was still held back. A tag split across pieces is held until it is
complete; a `<tool_call>` block is held whole and parsed when it closes; one that does not
parse (or never closes) comes out as plain content, as the model wrote it.
"""

from __future__ import annotations

import json

from kestrel_cli.text.constrained import MAX_JSON_DEPTH, too_deep

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"


def prompt_opens_thinking(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an open <think> block (templates that write
    the opening tag themselves, e.g. Qwen3-*-Thinking-2507)."""
    tail = prompt_text.rstrip()
    return tail.endswith(THINK_OPEN)


def _partial_tail(text: str, tags) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `tags`."""
    best = 0
    for tag in tags:
        for n in range(min(len(tag) - 1, len(text)), 0, -1):
            if text.endswith(tag[:n]):
                best = max(best, n)
                break
    return best


def parse_tool_call(body: str) -> dict | None:
    """The JSON inside <tool_call>…</tool_call> -> {"name", "arguments" (a JSON string)},
    or None when it is not {"name": str, "arguments": object}."""
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", {})
    if isinstance(args, str):  # some models write the arguments as a string
        try:
            args = json.loads(args)
        except (ValueError, RecursionError):
            return None
    # arguments nested past the request limit are not a call (json.dumps would recurse)
    if not isinstance(args, dict) or too_deep(args, MAX_JSON_DEPTH):
        return None
    return {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}


class AnswerSplitter:
    """Streams an answer's text into reasoning, content and tool calls (see the module)."""

    def __init__(self, thinking: bool = True, in_thinking: bool = False, tools: bool = False):
        # thinking: split a <think> block that opens the answer; in_thinking: the prompt
        # already opened it; tools: parse <tool_call> blocks in the content
        self.state = "reasoning" if in_thinking else ("start" if thinking else "content")
        self.tools = tools
        self.buf = ""
        self.calls = 0
        self._strip: str | None = None  # characters to strip from the next text ("" none)

    def feed(self, text: str) -> list[tuple[str, object]]:
        self.buf += text
        out: list[tuple[str, object]] = []
        while True:
            n = len(out)
            self._step(out, final=False)
            if len(out) == n:
                return [p for p in out if p[1] != ""]

    def finish(self) -> list[tuple[str, object]]:
        out: list[tuple[str, object]] = []
        while self.buf:
            before = (self.state, self.buf)
            self._step(out, final=True)
            if (self.state, self.buf) == before:
                break
        if self.buf:
            out.append(("reasoning" if self.state == "reasoning" else "content", self.buf))
            self.buf = ""
        return [p for p in out if p[1] != ""]

    def _step(self, out: list, final: bool) -> None:
        if self._strip is not None:  # leading newlines after a tag, however it streams
            self.buf = self.buf.lstrip(self._strip or None)
            if not self.buf:
                return
            self._strip = None
        b = self.buf
        if self.state == "start":  # before the answer's first visible text
            s = b.lstrip()
            if s.startswith(THINK_OPEN):
                self.buf, self.state, self._strip = s[len(THINK_OPEN) :], "reasoning", "\n"
                out.append(("reasoning", ""))
            elif final or (s and not THINK_OPEN.startswith(s)):
                self.state = "content"
                out.append(("content", ""))
            return
        if self.state == "reasoning":
            i = b.find(THINK_CLOSE)
            if i >= 0:
                out.append(("reasoning", b[:i].rstrip("\n") if i else ""))
                self.buf, self.state, self._strip = b[i + len(THINK_CLOSE) :], "content", "\n"
                out.append(("content", ""))  # progress marker (dropped if empty)
                return
            keep = 0
            if not final:  # a tag's start, and newlines that may end it
                keep = _partial_tail(b, [THINK_CLOSE])
                rest = b[: len(b) - keep]
                keep += len(rest) - len(rest.rstrip("\n"))
            if b[: len(b) - keep]:
                out.append(("reasoning", b[: len(b) - keep]))
                self.buf = b[len(b) - keep :]
            return
        if self.state == "content":
            if not self.tools:
                if b:
                    out.append(("content", b))
                    self.buf = ""
                return
            i = b.find(CALL_OPEN)
            if i >= 0:
                if b[:i].strip():
                    out.append(("content", b[:i]))
                self.buf, self.state = b[i:], "call"
                out.append(("content", ""))
                return
            keep = 0 if final else _partial_tail(b, [CALL_OPEN])
            if b[: len(b) - keep]:
                out.append(("content", b[: len(b) - keep]))
                self.buf = b[len(b) - keep :]
            return
        if self.state == "call":  # buf starts with <tool_call>
            j = b.find(CALL_CLOSE)
            if j < 0:
                return  # held until it closes (finish: as content)
            raw = b[: j + len(CALL_CLOSE)]
            call = parse_tool_call(b[len(CALL_OPEN) : j].strip())
            if call is None:
                out.append(("content", raw))
            else:
                out.append(("tool_call", call))
                self.calls += 1
            rest = b[j + len(CALL_CLOSE) :]
            self.buf, self.state = rest, "content"
            self._strip = "" if call else None
            out.append(("content", ""))


def split_answer(text: str, **kw) -> tuple[str, str, list[dict]]:
    """A whole answer -> (reasoning, content, tool calls)."""
    sp = AnswerSplitter(**kw)
    parts = sp.feed(text) + sp.finish()
    reasoning = "".join(t for k, t in parts if k == "reasoning")
    content = "".join(t for k, t in parts if k == "content")
    return reasoning, content, [t for k, t in parts if k == "tool_call"]


DIM, RESET = "\x1b[2m", "\x1b[0m"


class ThinkingView:
    """The terminal's view of a streamed answer: on a terminal the reasoning is dimmed (its
    tags left out), elsewhere written as the model wrote it; `hide` leaves it out. `content`
    collects the answer without its reasoning (what a chat keeps in its history)."""

    def __init__(self, tty: bool, hide: bool = False, in_thinking: bool = False):
        self.split = AnswerSplitter(thinking=True, in_thinking=in_thinking)
        self.tty, self.hide = tty, hide
        self.content: list[str] = []
        self._dim = False  # inside dimmed text on the terminal
        self._thought = False  # some reasoning was shown

    def _show(self, parts) -> str:
        shown = []
        for kind, text in parts:
            if kind == "content":
                self.content.append(text)
                if self._dim:
                    shown.append(RESET + "\n\n")
                    self._dim = False
                if self.tty or self.hide:
                    shown.append(text)
            elif not self.hide and self.tty:
                if not self._dim:
                    shown.append(DIM)
                    self._dim = True
                shown.append(text)
        return "".join(shown)

    def feed(self, text: str) -> str:
        """Text to write for this piece of the answer."""
        shown = self._show(self.split.feed(text))
        return shown if (self.tty or self.hide) else text

    def finish(self) -> str:
        shown = self._show(self.split.finish())
        if self._dim:
            shown += RESET
            self._dim = False
        return shown if (self.tty or self.hide) else ""
