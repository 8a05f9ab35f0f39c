"""`kestrel serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the Engine.

    GET  /health                 {"status", "slots_idle", "slots_processing", "requests_queued"}
    GET  /v1/models              the one loaded model (id = the model file or directory name)
    POST /v1/chat/completions    messages -> chat template -> reply (or SSE chunks)
    POST /v1/completions         raw prompt text (or token ids) -> continuation

Concurrency: an Engine is not thread-safe and holds one KV cache, so each engine ("slot")
is driven by its own worker thread; `--parallel N` makes N slots whose engines share the
memory-mapped weights (`Engine.fork`) and each keep their own KV cache. Requests wait in
a bounded FIFO for a free slot (full -> 503); a request goes to the idle slot whose cache
shares the longest prefix with its prompt, so a chat growing turn by turn prefills only
its new tokens (`timings.cache_n`). The worker posts each Chunk to the request's asyncio
queue; a client that goes away sets the request's cancel flag, which the worker checks
between tokens.

Request fields: OpenAI's (sampling defaults temperature 1.0, top_p 1.0; temperature 0 is
greedy), plus llama-server's top_k, min_p, repeat_penalty, ignore_eos and cache_prompt
(false: prefill the whole prompt), and chat_template_kwargs (e.g. enable_thinking). Fields
that would change the reply's meaning (n > 1, logprobs, tools, penalties, ...) get 400
naming the field; unknown harmless fields are ignored. Replies carry llama-server's
`timings`. Errors have OpenAI's shape {"error": {"message", "type", "param", "code"}}.
"""
from __future__ import annotations

import asyncio
import collections
import hmac
import json
import logging
import math
import queue
import secrets
import signal
import threading
import time
from pathlib import Path
from typing import AsyncIterator

from . import __version__
from .engine import Engine
from .errors import KestrelError
from .generate import Chunk, Stats

try:
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException
except ImportError as e:                                  # the [serve] extra is missing
    raise KestrelError(f"kestrel serve needs fastapi and uvicorn ({e.name} is missing): "
                       "pip install 'kestrel-cli[serve]'") from None

log = logging.getLogger("kestrel.server")

MAX_BODY_BYTES = 32 << 20        # larger request bodies get 413
COMPLETIONS_MAX_TOKENS = 16      # OpenAI's default max_tokens for /v1/completions
TEMPLATE_RESERVED = {"messages", "add_generation_prompt", "tokenize", "tools", "documents",
                     "chat_template"}   # apply_chat_template's own arguments
_END = object()                  # job.events: the worker is done with this job
_CANCELLED = object()            # job.events: the client went away


# ---------------------------------------------------------------------------- errors

class APIError(Exception):
    """An HTTP error reply in OpenAI's shape."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, type: str | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type or {400: "invalid_request_error", 401: "authentication_error",
                             404: "not_found_error", 413: "invalid_request_error",
                             503: "unavailable_error"}.get(status, "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


def _unsupported(name: str, why: str = "") -> APIError:
    return APIError(f"'{name}' is not supported by this server{why}", param=name,
                    code="unsupported_parameter")


# ---------------------------------------------------------------------------- request parsing

_JSON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
               dict: "object", type(None): "null"}
_KINDS = {
    "integer": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "number": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "boolean": lambda v: isinstance(v, bool),
    "string": lambda v: isinstance(v, str),
    "array": lambda v: isinstance(v, list),
    "object": lambda v: isinstance(v, dict),
}


def _opt(body: dict, name: str, kind: str, default=None):
    """body[name] checked to be of JSON type `kind`; absent or null -> default."""
    v = body.get(name)
    if v is None:
        return default
    if not _KINDS[kind](v):
        article = "an" if kind[0] in "aeiou" else "a"
        raise APIError(f"'{name}' must be {article} {kind}, got "
                       f"{_JSON_TYPES.get(type(v), type(v).__name__)}", param=name)
    return v


def _range(name: str, v, lo=None, hi=None, lo_open=False):
    if (lo is not None and (v <= lo if lo_open else v < lo)) or (hi is not None and v > hi):
        lo_s = "" if lo is None else (f"> {lo}" if lo_open else f">= {lo}")
        hi_s = "" if hi is None else f"<= {hi}"
        raise APIError(f"'{name}' must be {' and '.join(s for s in (lo_s, hi_s) if s)}, "
                       f"got {v}", param=name)
    return v


# fields that would change what the reply means; accepted only at their neutral value
_NEUTRAL = {
    "n": lambda v: v == 1,
    "logit_bias": lambda v: v == {},
    "presence_penalty": lambda v: v == 0,
    "frequency_penalty": lambda v: v == 0,
    "logprobs": lambda v: v is False or v == 0,
    "top_logprobs": lambda v: v == 0,
    "tools": lambda v: v == [],
    "tool_choice": lambda v: v in ("none", "auto"),     # no tools (non-empty ones fail)
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "response_format": lambda v: isinstance(v, dict) and v.get("type") == "text",
    "modalities": lambda v: v == ["text"],
    "audio": lambda v: False,
    "prediction": lambda v: False,
    "web_search_options": lambda v: False,
    "echo": lambda v: v is False,                 # /v1/completions
    "suffix": lambda v: v == "",                  # /v1/completions
    "best_of": lambda v: v == 1,                  # /v1/completions
}


def _check_unsupported(body: dict) -> None:
    for name, neutral in _NEUTRAL.items():
        v = body.get(name)
        if v is not None and not neutral(v):
            why = ": one choice per request" if name == "n" else ""
            raise _unsupported(name, why)


def _sampling(body: dict, default_max_tokens: int) -> dict:
    """Engine.stream keyword arguments from the OpenAI sampling fields (OpenAI's defaults)."""
    for name in ("temperature", "top_p", "min_p", "repeat_penalty"):
        v = body.get(name)
        if isinstance(v, float) and not math.isfinite(v):
            raise APIError(f"'{name}' must be a finite number", param=name)
    temperature = _range("temperature", _opt(body, "temperature", "number", 1.0), 0)
    top_p = _range("top_p", _opt(body, "top_p", "number", 1.0), 0, 1)
    if top_p == 0:                     # the smallest set with mass >= 0: the top token
        temperature, top_p = 0.0, 1.0
    top_k = _range("top_k", _opt(body, "top_k", "integer", 0), 0)            # llama-server's
    min_p = _range("min_p", _opt(body, "min_p", "number", 0.0), 0, 1)        # extensions
    repeat_penalty = _range("repeat_penalty", _opt(body, "repeat_penalty", "number", 1.0), 0,
                            lo_open=True)
    seed = _opt(body, "seed", "integer")
    if seed is not None:
        seed &= (1 << 64) - 1          # numpy wants a non-negative seed; OpenAI allows int64
    stop = body.get("stop")
    if stop is None:
        stops = []
    elif isinstance(stop, str):
        stops = [stop]
    elif isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stops = stop
    else:
        raise APIError("'stop' must be a string or an array of strings", param="stop")
    max_tokens = default_max_tokens
    for name in ("max_tokens", "max_completion_tokens"):    # the newer name wins
        v = _opt(body, name, "integer")
        if v is not None:
            max_tokens = _range(name, v, 1)
    return dict(max_tokens=max_tokens, temperature=float(temperature), top_k=top_k,
                top_p=float(top_p), min_p=float(min_p), repeat_penalty=float(repeat_penalty),
                seed=seed, stop=[s for s in stops if s],
                ignore_eos=_opt(body, "ignore_eos", "boolean", False))


def _text_content(content, param: str) -> str:
    """A message's content: a string, or an array of text parts (joined with newlines)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"'{param}' must be a string or an array of content parts", param=param)
    texts = []
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise APIError(f"'{p}' must be an object", param=p)
        kind = part.get("type")
        if kind != "text":
            if isinstance(kind, str):
                raise _unsupported(f"{p}.type", f": only text parts (got {kind!r})")
            raise APIError(f"'{p}.type' must be a string", param=f"{p}.type")
        if not isinstance(part.get("text"), str):
            raise APIError(f"'{p}.text' must be a string", param=f"{p}.text")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if msgs is None:
        raise APIError("'messages' is required", param="messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError("'messages' must be a non-empty array", param="messages")
    out = []
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(f"'{p}' must be an object", param=p)
        role = m.get("role")
        if role in ("tool", "function") or m.get("tool_calls") or m.get("function_call"):
            raise _unsupported(f"{p}.role" if role in ("tool", "function") else
                               f"{p}.tool_calls", ": no tool calling")
        if role not in ("system", "developer", "user", "assistant"):
            raise APIError(f"'{p}.role' must be one of system, developer, user, assistant; "
                           f"got {role!r}", param=f"{p}.role")
        content = m.get("content")
        if content is None:
            if role != "assistant":
                raise APIError(f"'{p}.content' is required", param=f"{p}.content")
            content = ""
        out.append({"role": "system" if role == "developer" else role,
                    "content": _text_content(content, f"{p}.content")})
    return out


def _stream_flags(body: dict) -> tuple[bool, bool]:
    stream = _opt(body, "stream", "boolean", False)
    opts = _opt(body, "stream_options", "object", {})
    include_usage = _opt(opts, "include_usage", "boolean", False) if stream else False
    return stream, include_usage


# ---------------------------------------------------------------------------- scheduling

class Job:
    """One generation request, from the queue to its last chunk."""

    def __init__(self, ids: list[int], params: dict, loop: asyncio.AbstractEventLoop,
                 cache_prompt: bool = True):
        self.ids, self.params, self.loop = ids, params, loop
        self.cache_prompt = cache_prompt    # False: prefill the whole prompt (llama-server's)
        self.events: asyncio.Queue = asyncio.Queue()   # Chunk | APIError | _END | _CANCELLED
        self.cancelled = False      # set in the loop thread, read by the worker between tokens
        self.state = "queued"       # queued -> running -> done
        self.gen_ms = 0.0           # wall time from the end of prefill to the last token
        self.t_first: float | None = None    # when the first token reached the handler
        self.n_tokens = 0           # tokens that reached the handler

    def post(self, item) -> None:
        """From the worker thread: hand an event to the request's handler."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, item)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """The worker's chunks; raises APIError on an engine error, stops on cancel."""
        while True:
            ev = await self.events.get()
            if ev is _END or ev is _CANCELLED:
                return
            if isinstance(ev, APIError):
                raise ev
            if ev.token is not None:
                self.n_tokens += 1
                self.t_first = self.t_first or time.perf_counter()
            yield ev


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class Slot:
    """One engine and the worker thread that drives it."""

    def __init__(self, index: int, engine: Engine):
        self.index, self.engine = index, engine
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.job: Job | None = None
        self.thread: threading.Thread | None = None


class Scheduler:
    """A bounded FIFO of jobs in front of the slots. All its state lives in the event loop
    thread; workers only run jobs and post events back (call_soon_threadsafe)."""

    def __init__(self, engines: list[Engine], queue_size: int):
        self.slots = [Slot(i, e) for i, e in enumerate(engines)]
        self.idle = list(self.slots)
        self.pending: collections.deque[Job] = collections.deque()
        self.queue_size = queue_size
        self.closing = False
        self.loop: asyncio.AbstractEventLoop | None = None

    # -- loop thread
    def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        for s in self.slots:
            s.thread = threading.Thread(target=self._work, args=(s,), daemon=True,
                                        name=f"kestrel-slot-{s.index}")
            s.thread.start()

    def submit(self, job: Job) -> None:
        if self.closing:
            raise APIError("the server is shutting down", 503)
        if not self.idle and len(self.pending) >= self.queue_size:
            raise APIError(f"server busy: {len(self.pending)} requests already wait for "
                           f"{len(self.slots)} slot(s); retry later", 503)
        self.pending.append(job)
        self._dispatch()

    def cancel(self, job: Job) -> None:
        """The client went away: drop the job from the queue, or stop it at the next token."""
        if job.state == "done" or job.cancelled:
            return
        job.cancelled = True
        if job.state == "queued":
            try:
                self.pending.remove(job)
            except ValueError:
                pass
            job.state = "done"
        job.events.put_nowait(_CANCELLED)

    def _dispatch(self) -> None:
        while self.pending and self.idle:
            job = self.pending.popleft()
            # the idle slot whose KV cache shares the longest prefix with the prompt; on a
            # tie the one holding least, so other conversations keep their caches
            slot = max(self.idle, key=lambda s: (_common_prefix(s.engine.cached_ids, job.ids),
                                                 -len(s.engine.cached_ids)))
            self.idle.remove(slot)
            slot.job, job.state = job, "running"
            slot.inbox.put(job)

    def _released(self, slot: Slot) -> None:
        if slot.job is not None:
            slot.job.state = "done"
        slot.job = None
        self.idle.append(slot)
        self.idle.sort(key=lambda s: s.index)
        self._dispatch()

    def begin_shutdown(self, cancel_running: bool = False) -> None:
        """SIGINT/SIGTERM: refuse new work, fail the queued jobs with 503; running jobs
        finish (uvicorn cancels them after --shutdown-timeout) unless `cancel_running`."""
        self.closing = True
        while self.pending:
            job = self.pending.popleft()
            job.state = "done"
            job.events.put_nowait(APIError("the server is shutting down", 503))
        if cancel_running:
            for s in self.slots:
                if s.job is not None:
                    s.job.cancelled = True

    async def close(self) -> None:
        self.begin_shutdown(cancel_running=True)
        for s in self.slots:
            s.inbox.put(None)
        for s in self.slots:
            if s.thread is not None:
                await asyncio.to_thread(s.thread.join, 10.0)

    def health(self) -> dict:
        return {"status": "shutting down" if self.closing else "ok",
                "slots_idle": len(self.idle), "slots_processing": len(self.slots) - len(self.idle),
                "requests_queued": len(self.pending)}

    # -- worker threads
    def _work(self, slot: Slot) -> None:
        while True:
            job = slot.inbox.get()
            if job is None:
                return
            try:
                self._run(slot.engine, job)
            finally:
                job.post(_END)
                self.loop.call_soon_threadsafe(self._released, slot)

    @staticmethod
    def _run(eng: Engine, job: Job) -> None:
        if job.cancelled:
            return
        gen = None
        t0 = time.perf_counter()
        try:
            if not job.cache_prompt:
                eng.reset()
            gen = eng.stream(job.ids, **job.params)
            for chunk in gen:
                if chunk.stats is not None:
                    job.gen_ms = (time.perf_counter() - t0) * 1e3 - chunk.stats.prefill_ms
                job.post(chunk)
                if job.cancelled:          # checked between tokens: stops within one token
                    break
        except KestrelError as e:
            job.post(APIError(str(e), 400))
        except Exception as e:            # never let a request kill the worker
            log.exception("generation failed")
            eng.reset()                    # the KV cache may be half-written
            job.post(APIError(f"internal error: {type(e).__name__}: {e}", 500))
        finally:
            if gen is not None:
                gen.close()


# ---------------------------------------------------------------------------- replies

def _usage(stats: Stats) -> dict:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.generated_tokens,
            "total_tokens": stats.prompt_tokens + stats.generated_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}


def _timings(stats: Stats, gen_ms: float) -> dict:
    """llama-server's `timings`: prompt_* count only the tokens prefilled (not cache_n);
    predicted_* the tokens sampled, over the time from the end of prefill to the last."""
    pn, pms, gn, gms = stats.prefill_tokens, stats.prefill_ms, stats.generated_tokens, gen_ms
    return {"cache_n": stats.cached_tokens,
            "prompt_n": pn, "prompt_ms": round(pms, 3),
            "prompt_per_token_ms": round(pms / pn, 3) if pn else 0.0,
            "prompt_per_second": round(pn / pms * 1e3, 3) if pms > 0 else 0.0,
            "predicted_n": gn, "predicted_ms": round(gms, 3),
            "predicted_per_token_ms": round(gms / gn, 3) if gn else 0.0,
            "predicted_per_second": round(gn / gms * 1e3, 3) if gms > 0 else 0.0}


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Stream(StreamingResponse):
    """Server-sent events whose job is cancelled however the response ends: client gone,
    server shutting down, or an error."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _wait_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# ---------------------------------------------------------------------------- the app

def model_id(engine: Engine) -> str:
    return Path(str(engine.path)).name or str(engine.path)


def create_app(engines: list[Engine], api_key: str | None = None, queue_size: int = 32
               ) -> FastAPI:
    """The FastAPI app serving `engines` (one per slot, sharing weights and tokenizer)."""
    from contextlib import asynccontextmanager
    sched = Scheduler(engines, queue_size)
    eng0 = engines[0]
    mid, created = model_id(eng0), int(time.time())
    fingerprint = f"kestrel-{__version__}"

    @asynccontextmanager
    async def lifespan(app):
        sched.start()
        yield
        await sched.close()

    app = FastAPI(title="kestrel", lifespan=lifespan, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.scheduler = sched

    # -- cross-cutting: errors, auth, one log line per request
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        request.scope["kestrel.error"] = exc.message
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        return APIError(str(exc.detail), exc.status_code).response()

    @app.exception_handler(Exception)
    async def _crash(request, exc):
        log.exception("unhandled error")
        return APIError(f"internal error: {type(exc).__name__}", 500).response()

    async def read_json(request: Request) -> dict:
        size = 0
        parts = []
        async for part in request.stream():
            size += len(part)
            if size > MAX_BODY_BYTES:
                raise APIError(f"request body larger than {MAX_BODY_BYTES >> 20} MiB", 413)
            parts.append(part)

        def no_constant(name):
            raise ValueError(f"{name} is not valid JSON")
        try:
            body = json.loads(b"".join(parts), parse_constant=no_constant)
        except (ValueError, RecursionError) as e:
            raise APIError(f"malformed JSON body: {e}", 400) from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object", 400)
        model = body.get("model")
        if model is not None and not isinstance(model, str):
            raise APIError("'model' must be a string", param="model")
        return body

    async def admit(request: Request, ids: list[int], params: dict, param: str,
                    cache_prompt: bool) -> Job:
        if len(ids) > eng0.ctx_size:
            raise APIError(f"the prompt has {len(ids)} tokens, more than the context size "
                           f"{eng0.ctx_size} (start the server with a larger -c/--ctx-size)",
                           400, param=param, code="context_length_exceeded")
        if not ids:
            raise APIError("empty prompt", 400, param=param)
        job = Job(ids, params, asyncio.get_running_loop(), cache_prompt)
        request.scope["kestrel.job"] = job
        sched.submit(job)
        return job

    async def encode(prompt, param: str, **kw) -> list[int]:
        try:
            return await asyncio.to_thread(eng0.encode_prompt, prompt, **kw)
        except KestrelError as e:
            raise APIError(str(e), 400, param=param) from None

    def finish_log(request: Request, job: Job, stats: Stats | None, finish: str) -> None:
        request.scope["kestrel.log"] = (job, stats, finish)

    async def generate(request: Request, job: Job, stream: bool, include_usage: bool,
                       kind: str):
        """The reply to an admitted job: one JSON object, or SSE chunks."""
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        obj = "chat.completion" if kind == "chat" else "text_completion"
        if stream and kind == "chat":
            obj = "chat.completion.chunk"
        head = {"id": rid, "object": obj,
                "created": int(time.time()), "model": mid, "system_fingerprint": fingerprint}

        if not stream:
            watch = asyncio.create_task(_wait_disconnect(request.receive))
            watch.add_done_callback(lambda t: t.cancelled() or sched.cancel(job))
            pieces, last = [], None
            try:
                async for ch in job.chunks():
                    if ch.text:
                        pieces.append(ch.text)
                    last = ch if ch.finish_reason else last
            finally:
                watch.cancel()
                if last is None:                       # client gone, error or shutdown
                    sched.cancel(job)
            if last is None:                           # cancelled: the client is gone
                finish_log(request, job, None, "cancelled")
                return JSONResponse({}, status_code=499)
            text = "".join(pieces)
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}}
                      if kind == "chat" else {"index": 0, "text": text})
            choice.update(logprobs=None, finish_reason=last.finish_reason)
            finish_log(request, job, last.stats, last.finish_reason)
            return JSONResponse({**head, "choices": [choice], "usage": _usage(last.stats),
                                 "timings": _timings(last.stats, job.gen_ms)})

        def chunk(delta_or_text, finish=None, **extra) -> dict:
            c = ({"index": 0, "delta": delta_or_text} if kind == "chat"
                 else {"index": 0, "text": delta_or_text})
            c.update(logprobs=None, finish_reason=finish)
            out = {**head, "choices": [c], **extra}
            if include_usage:
                out["usage"] = None
            return out

        async def events():
            last = None
            if kind == "chat":
                yield _sse(chunk({"role": "assistant", "content": ""}))
            try:
                async for ch in job.chunks():
                    if ch.text:
                        yield _sse(chunk({"content": ch.text} if kind == "chat" else ch.text))
                    last = ch if ch.finish_reason else last
            except APIError as e:
                finish_log(request, job, None, "error")
                request.scope["kestrel.error"] = e.message
                yield _sse(e.body())
                return
            if last is None:
                finish_log(request, job, None, "cancelled")
                return
            finish_log(request, job, last.stats, last.finish_reason)
            yield _sse(chunk({} if kind == "chat" else "", last.finish_reason,
                             timings=_timings(last.stats, job.gen_ms)))
            if include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(last.stats),
                            "timings": _timings(last.stats, job.gen_ms)})
            yield "data: [DONE]\n\n"

        def on_close():
            if job.state != "done":
                sched.cancel(job)
                request.scope.setdefault("kestrel.log", (job, None, "cancelled"))
        return _Stream(events(), on_close)

    # -- routes
    @app.get("/health")
    async def health():
        h = sched.health()
        return JSONResponse(h, status_code=503 if sched.closing else 200)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{
            "id": mid, "object": "model", "created": created, "owned_by": "kestrel",
            "meta": {"architecture": eng0.config.model_type, "n_ctx": eng0.ctx_size,
                     "n_vocab": eng0.config.vocab_size, "parallel": len(engines)}}]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != mid:
            raise APIError(f"model {name!r} not found; this server has {mid!r}", 404,
                           param="model", code="model_not_found")
        return {"id": mid, "object": "model", "created": created, "owned_by": "kestrel"}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        _check_unsupported(body)
        messages = _messages(body)
        kwargs = _opt(body, "chat_template_kwargs", "object", {})
        bad = sorted(TEMPLATE_RESERVED & set(kwargs))
        if bad:
            raise APIError(f"'chat_template_kwargs.{bad[0]}' is not allowed",
                           param=f"chat_template_kwargs.{bad[0]}")
        params = _sampling(body, eng0.ctx_size)
        stream, include_usage = _stream_flags(body)
        cache_prompt = _opt(body, "cache_prompt", "boolean", True)
        ids = await encode(messages, "messages", **kwargs)
        job = await admit(request, ids, params, "messages", cache_prompt)
        return await generate(request, job, stream, include_usage, "chat")

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        _check_unsupported(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]                  # a batch of one
        if isinstance(prompt, list) and prompt and all(_KINDS["integer"](t) for t in prompt):
            pass                                # token ids, used as is
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list))
                                                         for p in prompt):
            raise _unsupported("prompt", ": one prompt per request, not a batch")
        elif not isinstance(prompt, str):
            raise APIError("'prompt' must be a string or an array of token ids"
                           if prompt is not None else "'prompt' is required", param="prompt")
        params = _sampling(body, COMPLETIONS_MAX_TOKENS)
        stream, include_usage = _stream_flags(body)
        cache_prompt = _opt(body, "cache_prompt", "boolean", True)
        ids = await encode(prompt, "prompt")
        job = await admit(request, ids, params, "prompt", cache_prompt)
        return await generate(request, job, stream, include_usage, "completion")

    app.add_middleware(_FrontDoor, api_key=api_key)
    return app


class _FrontDoor:
    """Plain ASGI middleware (no buffering, so streams and disconnects pass through):
    checks the API key on /v1/*, then logs one line per request with status, tokens and
    time (the handlers leave `kestrel.log` = (job, stats, finish) in the scope)."""

    def __init__(self, app, api_key: str | None = None):
        self.app, self.api_key = app, api_key

    def _authorized(self, scope) -> bool:
        if self.api_key is None or not scope["path"].startswith("/v1/"):
            return True
        headers = dict(scope.get("headers") or [])
        scheme, _, token = headers.get(b"authorization", b"").decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            token.strip().encode("latin-1"), self.api_key.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = [None]

        async def send_(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
        try:
            if self._authorized(scope):
                await self.app(scope, receive, send_)
            else:
                await APIError("invalid or missing API key (send 'Authorization: Bearer KEY')",
                               401, code="invalid_api_key").response()(scope, receive, send_)
        finally:
            self._line(scope, status[0], t0)

    @staticmethod
    def _line(scope, status, t0) -> None:
        ms = (time.perf_counter() - t0) * 1e3
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        parts = [who, f'"{scope["method"]} {scope["path"]}"', str(status or "-")]
        job, stats, finish = scope.get("kestrel.log", (scope.get("kestrel.job"), None, None))
        if stats is not None:
            parts.append(f"prompt={stats.prompt_tokens} cached={stats.cached_tokens} "
                         f"completion={stats.generated_tokens}")
        elif job is not None and job.n_tokens:
            parts.append(f"completion={job.n_tokens}")
        if finish is not None:
            parts.append(f"finish={finish}")
        if scope.get("kestrel.error"):
            parts.append(f"error={json.dumps(scope['kestrel.error'])}")
        if job is not None and getattr(job, "t_first", None) is not None:
            parts.append(f"ttft={(job.t_first - t0) * 1e3:.0f}ms")
        parts.append(f"{ms:.0f}ms")
        log.info(" ".join(parts))


# ---------------------------------------------------------------------------- running it

class _Server(uvicorn.Server):
    """uvicorn's server, telling the scheduler when SIGINT/SIGTERM arrives."""

    scheduler: Scheduler | None = None

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        loop, sched = getattr(self, "_loop", None), self.scheduler
        if sched is not None and loop is not None:
            loop.call_soon_threadsafe(sched.begin_shutdown, not first or self.force_exit)

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)


def _setup_logging() -> None:
    if log.handlers:
        return
    from uvicorn.logging import DefaultFormatter
    h = logging.StreamHandler()
    h.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    log.addHandler(h)
    log.setLevel(logging.INFO)
    log.propagate = False


def serve(engines: list[Engine], host: str = "127.0.0.1", port: int = 8080,
          api_key: str | None = None, queue_size: int = 32,
          shutdown_timeout: float = 5.0) -> None:
    """Serve until SIGINT/SIGTERM; then in-flight requests get `shutdown_timeout` seconds
    to finish before they are cancelled, queued ones get 503, and this returns."""
    _setup_logging()
    app = create_app(engines, api_key=api_key, queue_size=queue_size)
    config = uvicorn.Config(app, host=host, port=port, access_log=False, log_level="info",
                            timeout_graceful_shutdown=shutdown_timeout, lifespan="on")
    server = _Server(config)
    server.scheduler = app.state.scheduler
    eng = engines[0]
    log.info(f"model {model_id(eng)} ({eng.config.model_type}), context {eng.ctx_size}, "
             f"{len(engines)} slot(s) x {eng.threads} thread(s), queue {queue_size}"
             + (", API key required" if api_key else ""))
    if api_key is None and host not in ("127.0.0.1", "localhost", "::1"):
        log.warning(f"listening on {host} without --api-key: anyone who can reach it can use it")
    # uvicorn re-raises the signal it handled once it has shut down; make that a no-op so
    # a requested shutdown ends with status 0 instead of dying from the signal
    saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    for s in saved:
        signal.signal(s, lambda *a: None)
    try:
        server.run()
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
    log.info("server stopped")
