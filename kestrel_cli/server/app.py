"""The FastAPI app: routes, replies (JSON or server-sent events), one log line per request,
and running it under uvicorn until SIGINT/SIGTERM."""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import secrets
import signal
import time
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import __version__
from ..engine import Engine
from ..errors import KestrelError
from ..generate import Stats
from ..reasoning import AnswerSplitter, prompt_opens_thinking
from .models import (COMPLETIONS_MAX_TOKENS, APIError, Options, check_unsupported,
                     parse_messages, parse_prompt, parse_tools, content_chars)
from .scheduler import Job, Scheduler

log = logging.getLogger("kestrel.server")

MAX_BODY_BYTES = 32 << 20        # larger request bodies get 413


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

    # a prompt longer than this cannot fit the context: refused before it is rendered or tokenised
    max_chars = eng0.tokenizer.max_text_chars(eng0.ctx_size)

    def bound_prompt(n_chars: int, param: str) -> None:
        if n_chars > max_chars:
            raise APIError(f"the prompt has {n_chars} characters, more than a context of "
                           f"{eng0.ctx_size} tokens can hold (start the server with a larger "
                           f"-c/--ctx-size)", 400, param=param, code="context_length_exceeded")

    async def encode(prompt, param: str, **kw) -> list[int]:
        """Template and tokeniser run in a worker thread: the event loop keeps serving."""
        try:
            return await asyncio.to_thread(eng0.encode_prompt, prompt, **kw)
        except KestrelError as e:
            raise APIError(str(e), 400, param=param) from None

    def finish_log(request: Request, job: Job, stats: Stats | None, finish: str) -> None:
        request.scope["kestrel.log"] = (job, stats, finish)

    import functools

    @functools.lru_cache(maxsize=65536)
    def tok_text(t: int) -> str:
        return eng0.tokenizer.decode([t])

    def lp_entry(t: int, lp: float) -> dict:
        s = tok_text(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    def chat_logprobs(chunks) -> dict:
        """OpenAI's chat `logprobs` of the tokens of `chunks`."""
        return {"content": [{**lp_entry(c.token, c.logprob[0]),
                             "top_logprobs": [lp_entry(t, v) for t, v in c.logprob[1]]}
                            for c in chunks]}

    def completion_logprobs(chunks, offset: int) -> dict:
        """/v1/completions' legacy `logprobs` (text_offset counted from `offset`)."""
        out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for c in chunks:
            s = tok_text(c.token)
            out["tokens"].append(s)
            out["token_logprobs"].append(c.logprob[0])
            out["top_logprobs"].append({tok_text(t): v for t, v in c.logprob[1]})
            out["text_offset"].append(offset)
            offset += len(s)
        return out

    def split_parts(sp: AnswerSplitter, parts, calls: list) -> list[dict]:
        """Splitter parts -> chat deltas (tool calls numbered and given ids)."""
        deltas = []
        for k, v in parts:
            if k == "reasoning":
                deltas.append({"reasoning_content": v})
            elif k == "content":
                deltas.append({"content": v})
            else:
                call = {"index": len(calls), "id": "call_" + secrets.token_hex(12),
                        "type": "function", "function": dict(v)}
                calls.append(call)
                deltas.append({"tool_calls": [call]})
        return deltas

    async def generate(request: Request, job: Job, stream: bool, include_usage: bool,
                       kind: str, split: dict | None = None, prefix: str = "",
                       suffix: str = ""):
        """The reply to an admitted job: one JSON object, or SSE chunks. Chat answers go
        through an AnswerSplitter (`split`: its arguments): reasoning_content, content and
        tool_calls; `prefix` is answer text the prompt already holds (a forced tool call)."""
        sp = AnswerSplitter(**split) if split is not None else None
        calls: list[dict] = []
        want_lp = job.params.get("logprobs") is not None
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        obj = "chat.completion" if kind == "chat" else "text_completion"
        if stream and kind == "chat":
            obj = "chat.completion.chunk"
        head = {"id": rid, "object": obj,
                "created": int(time.time()), "model": mid, "system_fingerprint": fingerprint}

        if not stream:
            watch = asyncio.create_task(_wait_disconnect(request.receive))
            watch.add_done_callback(lambda t: t.cancelled() or sched.cancel(job))
            pieces, last, scored = [], None, []
            try:
                async for ch in job.chunks():
                    if ch.text:
                        pieces.append(ch.text)
                    if ch.logprob is not None:
                        scored.append(ch)
                    last = ch if ch.finish_reason else last
            finally:
                watch.cancel()
                if last is None:                       # client gone, error or shutdown
                    sched.cancel(job)
            if last is None:                           # cancelled: the client is gone
                finish_log(request, job, None, "cancelled")
                return JSONResponse({}, status_code=499)
            text = "".join(pieces)
            finish = last.finish_reason
            if sp is not None:
                parts = sp.feed(prefix + text + suffix) + sp.finish()
                deltas = split_parts(sp, parts, calls)
                msg = {"role": "assistant",
                       "content": "".join(d.get("content", "") for d in deltas)}
                reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
                if reasoning:
                    msg["reasoning_content"] = reasoning
                if calls:
                    msg["content"] = msg["content"] or None
                    msg["tool_calls"] = [{k: c[k] for k in ("id", "type", "function")}
                                         for c in calls]
                    finish = "tool_calls"
                choice = {"index": 0, "message": msg}
            else:
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}}
                          if kind == "chat" else {"index": 0, "text": text})
            lps = None
            if want_lp:
                lps = chat_logprobs(scored) if kind == "chat" else completion_logprobs(scored, 0)
            choice.update(logprobs=lps, finish_reason=finish)
            finish_log(request, job, last.stats, last.finish_reason)
            return JSONResponse({**head, "choices": [choice], "usage": _usage(last.stats),
                                 "timings": _timings(last.stats, job.gen_ms)})

        scored: list = []                 # tokens whose logprobs no event has carried yet
        offset = [0]

        def take_logprobs():
            if not want_lp:
                return None
            got, scored[:] = list(scored), []
            if kind == "chat":
                return chat_logprobs(got)
            lps = completion_logprobs(got, offset[0])
            offset[0] += sum(len(t) for t in lps["tokens"])
            return lps

        def chunk(delta_or_text, finish=None, **extra) -> dict:
            c = ({"index": 0, "delta": delta_or_text} if kind == "chat"
                 else {"index": 0, "text": delta_or_text})
            c.update(logprobs=take_logprobs() if scored or finish else None,
                     finish_reason=finish)
            out = {**head, "choices": [c], **extra}
            if include_usage:
                out["usage"] = None
            return out

        async def events():
            last = None
            if kind == "chat":
                yield _sse(chunk({"role": "assistant", "content": ""}))
            try:
                if sp is not None and prefix:
                    for d in split_parts(sp, sp.feed(prefix), calls):
                        yield _sse(chunk(d))
                async for ch in job.chunks():
                    if ch.logprob is not None:
                        scored.append(ch)
                    if ch.text and sp is not None:
                        for d in split_parts(sp, sp.feed(ch.text), calls):
                            yield _sse(chunk(d))
                    elif ch.text:
                        yield _sse(chunk({"content": ch.text} if kind == "chat" else ch.text))
                    last = ch if ch.finish_reason else last
                if last is not None and sp is not None:
                    for d in split_parts(sp, sp.feed(suffix) + sp.finish(), calls):
                        yield _sse(chunk(d))
            except APIError as e:
                finish_log(request, job, None, "error")
                request.scope["kestrel.error"] = e.message
                yield _sse(e.body())
                return
            if last is None:
                finish_log(request, job, None, "cancelled")
                return
            finish_log(request, job, last.stats, last.finish_reason)
            yield _sse(chunk({} if kind == "chat" else "",
                             "tool_calls" if calls else last.finish_reason,
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

    def forced_schema(tools: list[dict], name: str) -> tuple[dict, str]:
        """(schema, text after it) of a forced call: a named function's arguments then the
        call's closing "}"; for 'required' the whole {"name", "arguments"} of one tool."""
        params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
                  for t in tools}
        if name:
            return params[name], "}"
        return {"anyOf": [{"type": "object", "properties": {"name": {"const": n},
                                                            "arguments": p},
                           "required": ["name", "arguments"], "additionalProperties": False}
                          for n, p in params.items()]}, ""

    async def answer(request: Request, opts: Options, prompt, param: str, kind: str,
                     forced: str | None = None, **kw):
        ids = await encode(prompt, param, **kw)
        split, prefix = None, ""
        if kind == "chat":
            try:
                tail = eng0.tokenizer.decode([int(t) for t in ids[-4:]])
            except (TypeError, ValueError):        # a vision prompt
                tail = ""
            split = dict(thinking=True, in_thinking=prompt_opens_thinking(tail),
                         tools=kw.get("tools") is not None)
            if forced is not None:                 # tool_choice required / a named function
                prefix = "<tool_call>\n" + (f'{{"name": {json.dumps(forced)}, "arguments": '
                                            if forced else "")
                if split["in_thinking"]:
                    prefix = "</think>\n\n" + prefix
                ids = list(ids) + eng0.tokenizer.encode(prefix)
        default_max = eng0.ctx_size if kind == "chat" else COMPLETIONS_MAX_TOKENS
        params = opts.sampling(default_max)
        suffix = ""
        if forced is not None:                     # the call's JSON enforced while sampling
            params["json_schema"], params["json_then"] = forced_schema(kw["tools"], forced)
            suffix = "\n</tool_call>"
        job = await admit(request, ids, params, param, opts.cache_prompt)
        return await generate(request, job, opts.stream, opts.include_usage, kind, split,
                              prefix, suffix)

    async def check_schema(schema: dict) -> None:
        """A schema llguidance cannot compile is the request's error (400), found early."""
        from ..constrained import JsonConstraint
        try:
            await asyncio.to_thread(JsonConstraint, eng0, schema)
        except KestrelError as e:
            raise APIError(str(e), 400, param="response_format") from None

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = await read_json(request)
        check_unsupported(body)
        messages = parse_messages(body)
        tools, forced = parse_tools(body)
        opts = Options.parse(body)
        kwargs = opts.template_kwargs()
        if opts.json_schema is not None:
            await check_schema(opts.json_schema)
            if "enable_thinking" not in kwargs:
                kwargs["enable_thinking"] = False  # the answer is JSON from its first token
        if tools is not None:
            kwargs["tools"] = tools
        if forced is not None:
            await check_schema(forced_schema(tools, forced)[0])
        bound_prompt(sum(content_chars(m["content"]) for m in messages), "messages")
        return await answer(request, opts, messages, "messages", "chat", forced=forced,
                            max_chars=max_chars, **kwargs)

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        check_unsupported(body)
        prompt = parse_prompt(body)
        opts = Options.parse(body)
        if isinstance(prompt, str):
            bound_prompt(len(prompt), "prompt")
        return await answer(request, opts, prompt, "prompt", "completion")

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
