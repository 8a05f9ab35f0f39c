"""Continuous batching: one thread runs the model for the sequences of many engines.

`serve --parallel N` gives each slot an Engine of its own (its KV cache, its prompt prefix,
its sampling loop in its own thread) on shared weights. Without batching the N engines each
read every weight for each of their tokens, so N streams cost N times the memory traffic of
one. With a Batcher the engines hand their model calls to its thread instead: each step
runs one token of every decoding sequence in one pass (Model.forward_rows: the weights are
read once for all rows, attention runs per sequence over its own cache), and the next
`chunk` tokens of the waiting prompts, first come first (several prompts' chunks in one
pass of their own; a short prompt with the decode rows when they fit the GEMV): each token
is computed as it would be alone, so greedy answers do not depend on what else runs.
Sequences join and leave between steps; a long prompt is prefilled a chunk per step, so it
does not stall the others for its whole length; and a step waits briefly for every decoding
sequence's next token (they sample in their own threads) so that they stay in one pass.
When no sequence is decoding, nobody waits on a prompt pass: the prompts that arrive
together (clients starting at once) gather until none has come for gather_s (a burst's
requests reach the batch thread some milliseconds apart) and run in one pass of up to
`batch` tokens, so that they all start decoding in the same step.

Everything that runs kernels runs in the batch thread: the engines' threads only sample,
detokenise and check stop strings. The model's `-t` threads are shared by all sequences.
"""

from __future__ import annotations

import collections
import threading
import time

import numpy as np

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.runtime.kernels import ROWS_MAX

PREFILL_CHUNK = 256  # prompt tokens per step while sequences decode
PREFILL_BATCH = 1024  # prompt tokens per step when none decodes (llama.cpp's -b is 2048)
GATHER_S = 0.02  # how long a step waits for the decoding sequences' next tokens
PROMPT_GATHER = 10  # a burst of prompts is gathered for at most this many GATHER_S


class _Work:
    """One engine's request to the batch thread: tokens to run after its cache's, or a
    function to run alone (`solo`)."""

    __slots__ = (
        "engine",
        "ids",
        "positions",
        "all_logits",
        "solo",
        "done",
        "out",
        "err",
        "rows",
        "sent",
        "is_prompt",
    )

    def __init__(self, engine, ids=None, positions=None, all_logits=False, solo=None):
        self.engine, self.ids, self.positions = engine, ids, positions
        self.all_logits, self.solo = all_logits, solo
        self.done = threading.Event()
        self.out = self.err = None
        self.rows: list[np.ndarray] = []  # logits of the chunks run so far (all_logits)
        self.sent = 0  # tokens of ids run so far (a prompt runs a chunk per step)
        self.is_prompt = False  # queued as a prompt (chunked), not as a decode token

    def finish(self, out=None, err: BaseException | None = None) -> None:
        self.out, self.err = out, err
        self.done.set()


class Batcher:
    """The batch thread of a set of engines sharing one model's weights (see the module
    docstring). Engines call `run` (tokens after their cache's: a decode step or a prompt)
    and `solo` (anything else that runs kernels); both block their caller until done."""

    def __init__(
        self,
        model,
        chunk: int = PREFILL_CHUNK,
        gather_s: float = GATHER_S,
        batch: int = PREFILL_BATCH,
    ):
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        self.model, self.chunk, self.gather_s = model, chunk, gather_s
        self.batch = max(batch, chunk)
        self._cond = threading.Condition()
        self._decode: list[_Work] = []  # one-token requests, run together next step
        self._prompts: collections.deque[_Work] = collections.deque()  # chunk by chunk
        self._solo: collections.deque[_Work] = collections.deque()
        self._active: set[int] = set()  # id(engine) of engines in a generation
        self._busy: set[int] = set()  # of those, the ones with a prompt or solo queued
        self._closed = False
        self._last_prompt = 0.0  # when the latest prompt was queued (monotonic)
        self.steps = 0  # passes run (tests and stats)
        self.rows_run = 0  # token rows of those passes
        self._thread = threading.Thread(target=self._loop, daemon=True, name="kestrel-batch")
        self._thread.start()

    # -- engines' threads
    def run(self, engine, ids, positions=None, all_logits: bool = False) -> np.ndarray:
        """Run tokens `ids` after those in engine.cache, at RoPE `positions` (None: the
        cache offsets); logits of the last one (1, V), or of all (T, V) with
        `all_logits`. One token joins the next step; more are run `chunk` at a time."""
        ids = [int(t) for t in ids]
        if not ids:
            raise KestrelError("empty prompt")
        pos = None if positions is None else np.asarray(positions, dtype=np.int64).reshape(-1)
        w = _Work(engine, ids, pos, all_logits)
        with self._cond:
            self._check_open()
            self._active.add(id(engine))
            if len(ids) == 1 and not all_logits:
                self._decode.append(w)
            else:
                w.is_prompt = True
                self._busy.add(id(engine))
                self._prompts.append(w)
                self._last_prompt = time.monotonic()
            self._cond.notify_all()
        return self._wait(w)

    def solo(self, engine, fn):
        """fn() in the batch thread, between steps (a prompt with images: its vision
        tower and its M-RoPE positions run as one call)."""
        w = _Work(engine, solo=fn)
        with self._cond:
            self._check_open()
            self._active.add(id(engine))
            self._busy.add(id(engine))
            self._solo.append(w)
            self._cond.notify_all()
        return self._wait(w)

    def leave(self, engine) -> None:
        """The engine's generation is over: steps no longer wait for its tokens."""
        with self._cond:
            self._active.discard(id(engine))
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(10.0)

    def _check_open(self) -> None:
        if self._closed:
            raise KestrelError("the batch thread is closed")

    @staticmethod
    def _wait(w: _Work):
        w.done.wait()
        if w.err is not None:
            raise w.err
        return w.out

    # -- the batch thread
    def _ready(self, since: float | None) -> bool:
        """Whether a step should run now (the lock held): a solo call at once; else when
        every sequence that is decoding has sent its next token, or at `_due(since)`."""
        if self._solo:
            return True
        if not self._decode and not self._prompts:
            return False
        expected = self._active - self._busy
        if expected and expected <= {id(w.engine) for w in self._decode}:
            return True
        return since is not None and time.monotonic() >= self._due(since)

    def _due(self, since: float) -> float:
        """When a step whose first request came at `since` runs at the latest: gather_s
        after it; with prompts only and nobody decoding, once no prompt has come for
        gather_s (the prompts sent together: a burst's requests reach the batch thread
        some milliseconds apart), at most PROMPT_GATHER gather_s after it."""
        if self._active - self._busy:
            return since + self.gather_s
        return min(self._last_prompt + self.gather_s, since + PROMPT_GATHER * self.gather_s)

    def _loop(self) -> None:
        since = None  # when the first decode request of the coming step arrived
        while True:
            with self._cond:
                while not self._ready(since):
                    if self._closed:
                        self._fail_all(KestrelError("the batch thread is closed"))
                        return
                    if (self._decode or self._prompts) and since is None:
                        since = time.monotonic()
                    timeout = None
                    if since is not None:
                        timeout = max(0.0, self._due(since) - time.monotonic())
                    self._cond.wait(timeout)
                solo = self._solo.popleft() if self._solo else None
                decode, prompts = [], []
                if solo is None:
                    decode, self._decode = self._decode, []
                    prompts = list(self._prompts)
                decoding = bool(decode) or bool(self._active - self._busy)
                since = None
            if solo is not None:
                try:
                    solo.finish(solo.solo())
                except BaseException as e:  # the caller's error, raised in its thread
                    solo.finish(err=e)
                with self._cond:
                    self._busy.discard(id(solo.engine))
                continue
            self._step(decode, prompts, decoding)

    def _fail_all(self, err: BaseException) -> None:
        for w in [*self._decode, *self._prompts, *self._solo]:
            w.finish(err=err)
        self._decode, self._prompts, self._solo = [], collections.deque(), collections.deque()

    def _step(self, decode: list[_Work], prompts: list[_Work], decoding: bool) -> None:
        """Every decode request, and the next chunks of the waiting prompts (first come
        first, `chunk` tokens in all, `batch` when no sequence is `decoding`): the decode rows in one pass through the GEMV; a
        prompt of at most ROWS_MAX tokens, which takes the GEMV alone too, with them while
        the rows fit, else in a pass of its own; the longer prompts' chunks together in one
        pass through the GEMM (the weights' panels packed once for all of them). A token is
        computed as it would be alone, so greedy answers do not depend on what else runs."""
        gemv = [((w.engine.cache, w.ids, w.positions, "last"), w) for w in decode]
        # while sequences decode, a step's prompt tokens stall them: a chunk; else a batch
        limit = self.chunk if decoding else self.batch
        short, gemm, budget = [], [], limit
        for w in prompts:
            left = len(w.ids) - w.sent
            n = min(limit, left)
            if n < left and left - n <= ROWS_MAX:  # no short tail: as one prefill's rows
                n = left
            if n <= ROWS_MAX:  # a whole short prompt: the GEMV's rows, as alone
                if not gemm:  # (else its turn is the next step: first come first)
                    fits = len(decode) + n <= ROWS_MAX
                    (gemv if fits else short).append((self._seg(w, n), w))
                break
            if gemm and n > budget:
                break
            gemm.append((self._seg(w, n), w))
            budget -= n
            if budget <= 0:
                break
        for p in (gemv, short, gemm):
            keep = []
            for s, w in p:  # a sequence whose cache cannot take its tokens fails alone
                try:
                    s[0].reserve(len(s[1]))
                except KestrelError as e:
                    self._fail(w, e)
                    continue
                keep.append((s, w))
            if keep:
                self._pass(keep)

    @staticmethod
    def _seg(w: _Work, n: int) -> tuple:
        """The next n tokens of prompt w as a forward_rows segment."""
        a, b = w.sent, w.sent + n
        pos = None if w.positions is None else w.positions[a:b]
        want = "all" if w.all_logits else ("last" if b == len(w.ids) else None)
        return (w.engine.cache, w.ids[a:b], pos, want)

    def _pass(self, keep: list) -> None:
        """One model call over the sequences of `keep` ((segment, work) pairs)."""
        prof = self.model.prof
        a0, m0 = prof.snapshot()
        try:
            outs = self.model.forward_rows([s for s, _ in keep])
        except BaseException as e:  # every sequence of the pass sees the error
            for _, w in keep:
                self._fail(w, e)
            return
        a1, m1 = prof.snapshot()
        self.steps += 1
        self.rows_run += sum(len(s[1]) for s, _ in keep)
        for (s, w), out in zip(keep, outs):
            ep = getattr(w.engine.model, "prof", None)
            if ep is not None and ep is not prof:  # the pass's time, as each engine's
                ep.attn += a1 - a0
                ep.matmul += m1 - m0
            if not w.is_prompt:
                w.finish(out)
                continue
            w.sent += len(s[1])
            if out is not None:
                w.rows.append(out)
            if w.sent == len(w.ids):
                self._end_prompt(w)
                w.finish(np.concatenate(w.rows) if w.all_logits else w.rows[-1])

    def _fail(self, w: _Work, err: BaseException) -> None:
        if w.is_prompt:
            self._end_prompt(w)
        w.finish(err=err)

    def _end_prompt(self, w: _Work) -> None:
        with self._cond:
            try:
                self._prompts.remove(w)
            except ValueError:  # already taken off
                pass
            self._busy.discard(id(w.engine))
