"""Speculative decoding (--draft): a small draft model proposes the next tokens, the target
checks them all in one forward pass (docs/DESIGN.md §1 Layers, "Speculative decoding").

A step, after the sampler picked token t:
1. the draft catches up with the tokens the target accepted, then proposes up to n_max
   tokens d1..dn greedily, one decode step each (it stops early at a top probability under
   p_min, at an end-of-sequence token, at the reply's max_tokens or the context's end);
2. the target runs [t, d1..dn] in one pass (`Engine.verify`): n + 1 logits rows;
3. stream_generate consumes the rows one at a time with its usual per-token logic
   (penalties, bias, grammar, sampler, stops): when the token it samples at row j is
   d(j+1), row j+1 is already the right one (its input was that token) and is handed out
   without running anything; at the first mismatch (or the end of the reply) the rows left
   are dropped and both KV caches are trimmed back to the tokens fed.

The sampler always draws from the target's own row ("sample, then compare"): the output
has exactly the target's distribution for any sampler, and greedy output is the plain
decoder's token for token (up to the float summation order of the one-pass rows against
the one-token ones). The draft only decides how many rows one pass yields.
"""

from __future__ import annotations

import numpy as np

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.runtime.kernels import FLOAT_FMTS, ROWS_MAX

# the defaults (--help says why): on the bundled model's float32 target with its Q4_1 as the
# draft, 16 decoded ~1.2x faster than 8 and ~1.4x faster than 4, and p_min 0.1 cut 2% of
# 16's speed where llama.cpp's 0.75 cut most of the gain (docs/MEASUREMENTS.md)
# 15: the verify pass of 16 rows is then at most kernels.ROWS_MAX, the GEMV's rows, whose
# arithmetic is one-token decode's (so replies equal plain decoding's under --act q8 too)
DRAFT_MAX = 15  # --draft-max: tokens proposed per step at most
DRAFT_MIN = 0  # --draft-min: a shorter proposal is not verified (plain step instead)
DRAFT_P_MIN = 0.1  # --draft-p-min: the draft stops at a top probability below this
# the draft catches up this many tokens at most by decode steps, more in one prefill pass (a
# whole proposal accepted leaves it 2 behind: the last draft token and the new one); the
# prefill path's small-T GEMM costs several decode steps (docs/MEASUREMENTS.md)
CATCH_UP_STEPS = 8
DRAFT_MAX_CAP = 64  # --draft-max at most: one verify pass of that many rows
# the verify pass attends exactly (a prefill block) where decode would attend sparsely, and
# records prefill importance: not what plain decoding computes
NO_SPARSE = (
    "--draft does not work with sparse attention (--sparse-attn/--sparse): its verify "
    "pass attends exactly; give one or the other"
)


def check_settings(n_max: int, n_min: int, p_min: float) -> None:
    """KestrelError naming the flag of the first bad value."""
    if not 1 <= n_max <= DRAFT_MAX_CAP:
        raise KestrelError(f"--draft-max must be in 1..{DRAFT_MAX_CAP}, got {n_max}")
    if not 0 <= n_min <= n_max:
        raise KestrelError(f"--draft-min must be in 0..--draft-max ({n_max}), got {n_min}")
    if not 0.0 <= p_min <= 1.0:  # NaN fails too
        raise KestrelError(f"--draft-p-min must be in [0, 1], got {p_min}")


def check_vocab(target, draft) -> None:
    """KestrelError unless the two engines' tokenizers have the same token table (the
    draft's ids are the target's). Their logits may be wider than the table (padding rows);
    a draft id past the target's rows ends a proposal."""
    tt, dt = target.tokenizer, draft.tokenizer
    same = tt.vocab_size == dt.vocab_size and all(
        tt.id_to_token(i) == dt.id_to_token(i) for i in range(tt.vocab_size)
    )
    if not same:
        raise KestrelError(
            f"draft model {draft.path.name} has another vocabulary than "
            f"{target.path.name} ({dt.vocab_size} and {tt.vocab_size} tokens, or other "
            f"tokens at the same ids): a draft must share the target's tokenizer"
        )


def inexact_note(target, n_max: int = DRAFT_MAX) -> str | None:
    """A note for the user when greedy replies with a draft can differ from plain decoding:
    quantised weights under --act q8 with a verify pass of more than kernels.ROWS_MAX rows
    (the many-row GEMM rounds the activations otherwise than the one-token GEMV: logits
    apart by tenths) or MoE experts (their prefill kernel); else None."""
    if target.model.act != "q8":
        return None
    if n_max + 1 <= ROWS_MAX and not getattr(target.store, "expert_nbytes", 0):
        return None  # the GEMV's rows: each verify row is decode's arithmetic
    store = target.store
    entries = getattr(store, "entries", {})
    if getattr(store, "quant", None) is None and all(e[0] in FLOAT_FMTS for e in entries.values()):
        return None  # float weights multiply float32 activations: rows equal to decode's
    return (
        "with --act q8 on quantised weights the verify pass rounds activations otherwise than "
        "one-token decoding: a reply with --draft can differ from one without (--act f32: "
        "the same text)"
    )


class Speculator:
    """A target Engine's draft model and settings (Engine.set_draft); `steps` makes the
    logits source of one reply.

    Args:
        target: the Engine that answers.
        draft: the draft Engine (its own KV cache; same tokenizer).
        n_max: tokens proposed per step at most.
        n_min: a proposal shorter than this is not verified: the step runs the target on
            the sampled token alone.
        p_min: the draft stops proposing at a token whose probability (its softmax) is
            below this; 0: always n_max.
    """

    def __init__(
        self,
        target,
        draft,
        n_max: int = DRAFT_MAX,
        n_min: int = DRAFT_MIN,
        p_min: float = DRAFT_P_MIN,
    ):
        check_settings(n_max, n_min, p_min)
        if target.spec.sparse is not None:
            raise KestrelError(NO_SPARSE)
        check_vocab(target, draft)
        self.target, self.draft = target, draft
        self.n_max, self.n_min, self.p_min = n_max, n_min, p_min

    def fork(self, target) -> "Speculator":
        """The same settings for `target` (a fork of ours) with a forked draft (Engine.fork:
        shared weights, its own cache)."""
        s = object.__new__(Speculator)
        s.target, s.draft = target, self.draft.fork()
        s.n_max, s.n_min, s.p_min = self.n_max, self.n_min, self.p_min
        return s

    def steps(self, ids) -> "SpeculativeSteps":
        """The logits source of a reply to prompt `ids`; KestrelError for a prompt with
        images (the draft is a text model, and their M-RoPE positions are the target's)."""
        if getattr(ids, "images", None):
            raise KestrelError(
                "--draft does not take images: the draft model reads text only; "
                "drop --draft or the images"
            )
        return SpeculativeSteps(self)


class SpeculativeSteps:
    """stream_generate's logits rows from draft-and-verify passes (see the module's
    docstring). `offset` counts the tokens fed as the loop sees them: the target's cache
    may hold more (the pass's rows not consumed yet), which `finish` trims away. A reply
    cut short keeps them: their K/V are right for cached_ids, and the next prompt's prefix
    match keeps or drops them as for any cached token."""

    def __init__(self, spec: Speculator):
        self.target, self.draft = spec.target, spec.draft
        self.n_max, self.n_min, self.p_min = spec.n_max, spec.n_min, spec.p_min
        self.stop_ids: set[int] = set()
        self.length = 0  # tokens fed (the loop's context)
        self.rows: np.ndarray | None = None  # the last pass's logits (n + 1, V)
        self.proposal: list[int] = []  # its drafted tokens d1..dn
        self.row = 0  # the row handed out last
        self.drafted = self.accepted = 0

    def prefill(self, ids, stop_ids) -> tuple[np.ndarray, int]:
        self.stop_ids = set(stop_ids)
        logits, cached = self.target.prefill(ids)
        self.draft.prefill(ids)  # with its own prefix reuse
        self.length = len(ids)
        return logits, cached

    @property
    def offset(self) -> int:
        return self.length

    def step(self, token: int, ahead: int) -> np.ndarray:
        self.length += 1
        nxt = self.row + 1
        if self.rows is not None and nxt < len(self.rows) and token == self.proposal[self.row]:
            self.row = nxt  # the draft guessed the sampled token: its row is ready
            self.accepted += 1
            return self.rows[nxt : nxt + 1]
        self.length -= 1
        self.finish()  # back to the tokens fed: the rows left were for other tokens
        room = self.target.ctx_size - self.length - 1  # the pass writes 1 + n tokens
        proposal = self._propose(token, min(self.n_max, ahead, room))
        rows = self.target.verify([token] + proposal)
        self.length += 1
        self.rows, self.proposal, self.row = rows, proposal, 0
        self.drafted += len(proposal)
        return rows[0:1]

    def _propose(self, token: int, n: int) -> list[int]:
        """Up to n draft tokens to follow `token` (greedy, the draft's own steps); [] when
        fewer than max(1, n_min) come."""
        draft, target = self.draft, self.target
        n = min(n, draft.ctx_size - self.length)  # the draft's cache: length + n tokens
        if n < max(1, self.n_min):
            return []
        # catch up (finish() left the draft at most `length` tokens): the target's tokens
        # fed since the draft's last, then `token`
        behind = target.cached_ids[len(draft.cached_ids) : self.length] + [token]
        if len(behind) <= CATCH_UP_STEPS:  # the usual case: decode steps (the native stack)
            for t in behind:
                logits = draft.decode_step(t)
        else:  # after plain steps (n_min, context end): one pass
            logits = draft.verify(behind)
        vocab = target.config.vocab_size
        out: list[int] = []
        while True:
            row = logits[-1]
            d = int(np.argmax(row))
            if d >= vocab:  # a padding row of a wider draft: no token of the target's
                break
            if self.p_min > 0.0:
                top = float(row[d])
                p = 1.0 / float(np.exp(row.astype(np.float64) - top).sum())
                if p < self.p_min:
                    break
            out.append(d)
            if len(out) >= n or d in self.stop_ids:
                break
            logits = draft.decode_step(d)
        return out if len(out) >= self.n_min else []

    def finish(self) -> None:
        """Trim both caches to the tokens fed (the draft's to those it holds of them)."""
        n = self.length
        if len(self.target.cached_ids) > n:
            self.target.trim(n)
        if len(self.draft.cached_ids) > n:
            self.draft.trim(n)
        self.rows, self.proposal, self.row = None, [], 0
