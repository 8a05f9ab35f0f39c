"""Layered generators: generate_step (token ids) -> stream_generate (text chunks, stops, timing)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from kestrel_cli.inference.sampling import apply_repetition_penalty, check_logits


@dataclass
class TokenTiming:
    """One decoded token, the fields of the [DEC-SINGLE] line (milliseconds)."""

    tok: int  # index of the decoded token in this reply (the first sampled one is 0)
    pos: int  # its position in the context
    ms: float
    attn: float
    matmul: float

    @property
    def other(self) -> float:
        return max(0.0, self.ms - self.attn - self.matmul)


@dataclass
class Stats:
    prompt_tokens: int = 0  # tokens in the prompt
    cached_tokens: int = 0  # of which reused from the KV cache
    prefill_tokens: int = 0  # of which actually computed
    prefill_ms: float = 0.0
    decode_tokens: int = 0  # tokens generated after the first (timed per token)
    decode_ms: float = 0.0
    generated_tokens: int = 0  # all tokens sampled, incl. the first and any EOS
    attn_ms: float = 0.0  # attention time over the decode steps
    kv_bytes: int = 0
    vision_ms: float = 0.0  # vision tower time within prefill_ms (prompts with images)
    image_tokens: int = 0  # image tokens in the prompt
    vision_bits: int = 32  # the vision tower's operands: 16 bf16, 32 float32 (--vision-dtype)
    draft_tokens: int = 0  # speculative decoding: tokens the draft model proposed
    draft_accepted: int = 0  # of which the target sampled the same token

    @property
    def draft_rate(self) -> float:
        """Percent of the drafted tokens accepted (0 without a draft)."""
        return 100.0 * self.draft_accepted / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def prefill_tps(self) -> float:
        return self.prefill_tokens / (self.prefill_ms / 1e3) if self.prefill_ms > 0 else 0.0

    @property
    def decode_tps(self) -> float:
        return self.decode_tokens / (self.decode_ms / 1e3) if self.decode_ms > 0 else 0.0

    @property
    def attn_ms_per_tok(self) -> float:
        return self.attn_ms / self.decode_tokens if self.decode_tokens else 0.0


@dataclass
class Chunk:
    text: str  # new text (may be "")
    token: int | None = None  # the token that produced it
    finish_reason: str | None = None  # "stop" | "length" on the last chunk
    timing: TokenTiming | None = (
        None  # the decode step that produced this token (None for the first)
    )
    stats: Stats | None = None  # on the last chunk
    logprob: tuple | None = None  # (log p(token), [(id, log p), ...] top ones), when asked


def log_softmax(row) -> "np.ndarray":
    """log p over the vocabulary, in float64."""
    x = np.asarray(row, dtype=np.float64)
    x = x - x.max()
    return x - np.log(np.exp(x).sum())


def adjust_logits(
    row,
    logit_bias: dict | None,
    presence_penalty: float,
    frequency_penalty: float,
    generated: Sequence[int],
) -> None:
    """OpenAI's penalties, in place: minus presence_penalty for each token already generated,
    minus frequency_penalty times its count; then logit_bias added."""
    if (presence_penalty or frequency_penalty) and len(generated):
        ids, counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        row[ids] -= presence_penalty + frequency_penalty * counts
    if logit_bias:
        ids = np.fromiter(logit_bias.keys(), dtype=np.int64, count=len(logit_bias))
        row[ids] += np.fromiter(logit_bias.values(), dtype=np.float64, count=len(logit_bias))


def _stop_cut(text: str, stops: Sequence[str]) -> tuple[str, bool]:
    """(text safe to emit now, stopped?): text before the first stop string, minus any
    tail that could still grow into one."""
    hits = [text.find(s) for s in stops if s in text]
    if hits:
        return text[: min(hits)], True
    hold = 0
    for s in stops:  # keep back a tail that could still become a stop
        for n in range(min(len(s) - 1, len(text)), 0, -1):
            if text.endswith(s[:n]):
                hold = max(hold, n)
                break
    return text[: len(text) - hold], False


class DecodeSteps:
    """Where stream_generate's logits rows come from, one token at a time: the plain one
    runs one `decode_step` per token. speculative.SpeculativeSteps is the other (rows of a
    draft-and-verify pass). `offset` is the context's length as the loop sees it (the tokens
    fed so far); `finish` leaves the engine's cache holding exactly those."""

    drafted = accepted = 0  # draft tokens proposed / accepted (none here)

    def __init__(self, engine):
        self.engine = engine

    def prefill(self, ids, stop_ids) -> tuple[np.ndarray, int]:
        """The prompt's last logits (1, V) and its tokens reused from the cache."""
        return self.engine.prefill(ids)

    @property
    def offset(self) -> int:
        return self.engine.cache.offset

    def step(self, token: int, ahead: int) -> np.ndarray:
        """Feed `token`; the logits (1, V) of the next one. `ahead`: rows the loop may still
        ask for after this one (max_tokens)."""
        return self.engine.decode_step(token)

    def finish(self) -> None:
        pass


def stream_generate(
    engine,
    prompt_ids: list[int],
    max_tokens: int,
    sampler,
    repeat_penalty: float = 1.0,
    repeat_last_n: int = 64,
    stop: Sequence[str] = (),
    stop_ids: Sequence[int] | None = None,
    logit_bias: dict[int, float] | None = None,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    logprobs: int | None = None,
    constraint=None,
    processors: Sequence = (),
    steps=None,
) -> Iterator[Chunk]:
    """Prefill the prompt (reusing the engine's cached prefix), then sample token by token.

    Yields Chunks; the last one has finish_reason and stats. Stops on EOS ids, stop
    strings (never emitted), max_tokens, or a full context. With `logprobs` = k >= 0 each
    token's chunk carries its log-probability and the k likeliest tokens', from the
    model's distribution (log-softmax of its logits, before penalties, bias and sampling).
    A `constraint` (constrained.JsonConstraint) masks the logits before each step and ends
    the answer when its grammar is complete. `processors` (e.g. think_budget.ThinkBudget)
    do the same without ending it: each step every one `apply(row)`s its mask (after
    penalties and bias, before the constraint's), and each token picked but EOS is
    `advance`d through all of them; a token they force is an ordinary generated token.
    `steps` gives the logits rows (DecodeSteps, the default, or
    speculative.SpeculativeSteps); every row goes through the same logic here, whichever
    made it.
    """
    prof = engine.model.prof
    eos = set(engine.tokenizer.eos_token_ids if stop_ids is None else stop_ids)
    steps = steps if steps is not None else DecodeSteps(engine)
    stats = Stats(prompt_tokens=len(prompt_ids))
    t0 = time.perf_counter()
    logits, cached = steps.prefill(prompt_ids, eos)
    stats.cached_tokens, stats.prefill_tokens = cached, len(prompt_ids) - cached
    stats.prefill_ms = (time.perf_counter() - t0) * 1e3
    stats.vision_ms = float(getattr(engine, "vision_ms", 0.0))
    stats.image_tokens = int(getattr(engine, "image_tokens", 0))
    stats.vision_bits = int(getattr(engine.model, "vision_bits", 32))
    history = list(prompt_ids)
    detok = engine.tokenizer.detokenizer()
    pending, finish, stopped, complete = "", "length", False, False
    timing = None  # the decode step that produced the current logits
    token = -1  # the token sampled last (fed from the second step on)
    hooks = [*processors] + ([constraint] if constraint is not None else [])
    for i in range(max_tokens):
        if i > 0:  # feed the previous token (after its chunk went out)
            if steps.offset >= engine.ctx_size:
                break  # context full: finish "length"
            a0, m0 = prof.snapshot()
            s0 = time.perf_counter()
            logits = steps.step(token, max_tokens - i - 1)
            ms = (time.perf_counter() - s0) * 1e3
            a1, m1 = prof.snapshot()
            timing = TokenTiming(
                stats.decode_tokens, steps.offset - 1, ms, (a1 - a0) * 1e3, (m1 - m0) * 1e3
            )
            stats.decode_tokens += 1
            stats.decode_ms += ms
            stats.attn_ms += timing.attn
        row = logits[-1].copy()
        # the model's own row, before penalties and masks (-inf there is a grammar's):
        # NaN/Inf is a corrupt model, refused before a token is picked from it
        check_logits(row, len(history) - 1, getattr(engine, "path", None))
        lp = log_softmax(row) if logprobs is not None else None
        apply_repetition_penalty(
            row, history[-repeat_last_n:] if repeat_last_n else [], repeat_penalty
        )
        adjust_logits(
            row, logit_bias, presence_penalty, frequency_penalty, history[len(prompt_ids) :]
        )
        for h in hooks:
            h.apply(row)
        token = sampler(row)
        stats.generated_tokens += 1
        history.append(token)
        if token in eos:
            finish = "stop"
            break
        for h in hooks:
            h.advance(token)
        if constraint is not None:
            complete = constraint.done  # nothing but EOS may follow
        step, timing = timing, None
        pending += detok.add(token)
        emit = pending
        if stop:
            emit, stopped = _stop_cut(pending, stop)
        pending = pending[len(emit) :]
        info = None
        if lp is not None:
            top = np.argsort(-lp, kind="stable")[:logprobs] if logprobs else []
            info = (float(lp[token]), [(int(t), float(lp[t])) for t in top])
        yield Chunk(emit, token, timing=step, logprob=info)
        if stopped or complete:
            finish = "stop"
            break
    tail = ""
    if not stopped:
        tail = pending + detok.flush()
        cut = [tail.find(s) for s in stop if s in tail]
        tail = tail[: min(cut)] if cut else tail
    steps.finish()  # the cache holds the tokens fed, as after plain decoding
    stats.kv_bytes = engine.cache.nbytes
    stats.draft_tokens, stats.draft_accepted = steps.drafted, steps.accepted
    # a decode step whose token was EOS is reported on the last chunk
    yield Chunk(tail, None, finish_reason=finish, timing=timing, stats=stats)
