"""A thinking budget (`--reasoning-budget N`, llama.cpp's flag): at most N tokens inside
Qwen3's `<think>` block, then the block is closed by force and the answer follows.

`ThinkBudget` is a logits processor for inference.generate.stream_generate: `apply(row)`
masks the logits before a token is picked, `advance(token)` follows the token picked. It
reads the answer as text (its own detokenizer), as AnswerSplitter does:

- the block is open from the start when the prompt opened it (`prompt_opens_thinking` of
  the prompt's tail: templates that write `<think>` themselves), or opens when the answer
  starts with `<think>` (whitespace before it allowed); an answer that starts otherwise is
  never touched;
- inside it every generated token counts; a `</think>` the model writes itself ends the
  block, and the processor with it;
- once N tokens are spent, the closing text is forced: every logit but that of its next
  token set to -inf, one token per step. Qwen3 ends its thinking with `\\n</think>\\n\\n`;
  when the thinking already ends with a newline the forced text is `</think>\\n\\n`, when it
  ends with the start of the tag (`</th`) the rest of the tag and `\\n\\n`, otherwise
  `\\n</think>\\n\\n` (a sentence cut mid-line, or mid-character, is ended on its own
  line, as Qwen3 writes it). Each text is tokenised with the model's tokenizer.

The forced tokens are ordinary generated tokens: they count to max_tokens and appear in the
text, so the answer's split into reasoning and content is the same as for a block the model
closed itself. After the close it does nothing more. N = 0 closes the block at once (the
template's `enable_thinking` false renders an empty block, and this catches the templates
that open one anyway); -1 (or None) is no budget: `make` returns no processor.
"""

from __future__ import annotations

import numpy as np

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.text.reasoning import (
    THINK_CLOSE,
    THINK_OPEN,
    _partial_tail,
    prompt_opens_thinking,
)

_TAIL_CHARS = 64  # thinking text kept: enough to see a tag and the line's end


def check_budget(budget, what: str = "reasoning_budget") -> None:
    """A budget is an integer >= -1 (-1: unlimited, 0: no thinking); None is unlimited."""
    if budget is None:
        return
    if isinstance(budget, bool) or not isinstance(budget, (int, np.integer)) or budget < -1:
        raise KestrelError(
            f"{what} must be an integer >= -1 (-1: unlimited, 0: no thinking), got {budget!r}"
        )


def make(tokenizer, budget: int | None, prompt_ids) -> "ThinkBudget | None":
    """The processor for an answer to `prompt_ids` (None when `budget` is None or -1)."""
    check_budget(budget)
    if budget is None or budget < 0:
        return None
    try:
        tail = tokenizer.decode([int(t) for t in list(prompt_ids)[-4:]])
    except (TypeError, ValueError, KestrelError):
        tail = ""
    return ThinkBudget(tokenizer, int(budget), tail)


class ThinkBudget:
    """Close the `<think>` block after `budget` tokens (see the module)."""

    def __init__(self, tokenizer, budget: int, prompt_tail: str = ""):
        self.tokenizer = tokenizer
        self.budget = budget
        self.detok = tokenizer.detokenizer()
        self.spent = 0  # tokens generated inside the block
        self.forced: list[int] = []  # the closing text's tokens still to force
        if prompt_opens_thinking(prompt_tail):
            # the text after the prompt's <think> (its newline) is where the thinking starts
            self.state, self.text = "thinking", prompt_tail.rsplit(THINK_OPEN, 1)[-1]
        else:
            self.state, self.text = "start", ""

    @property
    def done(self) -> bool:
        """Nothing more to do: the block closed, or the answer did not open one."""
        return self.state == "done"

    def _close_text(self) -> str:
        part = _partial_tail(self.text, [THINK_CLOSE])
        if part:
            return THINK_CLOSE[part:] + "\n\n"
        return ("" if self.text.endswith("\n") else "\n") + THINK_CLOSE + "\n\n"

    def apply(self, row: np.ndarray) -> None:
        """In place: once the budget is spent, every logit but the next forced token's is
        -inf (that one set to 0, whatever penalties or biases made of it)."""
        if self.state == "thinking" and self.spent >= self.budget:
            # bytes of a character not yet complete count as text (U+FFFD): mid-line
            self.text += self.detok.flush()
            self.state = "forcing"
            self.forced = self.tokenizer.encode(self._close_text(), add_special_tokens=False)
        if self.state == "forcing":
            t = self.forced[0]
            row.fill(-np.inf)
            row[t] = 0.0

    def advance(self, token: int) -> None:
        if self.state == "done":
            return
        if self.state == "forcing":
            self.forced.pop(0)  # the token picked: every other one was -inf
            if not self.forced:
                self.state = "done"
            return
        piece = self.detok.add(token)
        if self.state == "start":  # the answer so far, its leading whitespace dropped
            self.text = (self.text + piece).lstrip()
            if self.text.startswith(THINK_OPEN):
                self.state, self.text = "thinking", self.text[len(THINK_OPEN) :]
            elif self.text and not THINK_OPEN.startswith(self.text):
                self.state = "done"  # the answer starts with something else
            return
        self.spent += 1
        self.text = (self.text + piece)[-_TAIL_CHARS:]
        if THINK_CLOSE in self.text:
            self.state = "done"  # the model closed the block itself
