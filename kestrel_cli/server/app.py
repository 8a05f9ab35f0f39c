"""The FastAPI app: routes, replies (JSON or server-sent events), one log line per request,
and running it under uvicorn until SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hmac
import ipaddress
import json
import logging
import re
import secrets
import signal
import time
from pathlib import Path

import h11
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from uvicorn.protocols.http.h11_impl import H11Protocol

from kestrel_cli import __version__
from kestrel_cli.core.errors import KestrelError, clip
from kestrel_cli.inference import kv_memory
from kestrel_cli.inference.batch import Batcher
from kestrel_cli.inference.engine import Engine
from kestrel_cli.inference.generate import Stats
from kestrel_cli.models.images import MAX_IMAGES_PER_PROMPT, probe_image
from kestrel_cli.models.video import MAX_VIDEOS_PER_PROMPT
from kestrel_cli.server import anthropic, responses
from kestrel_cli.server.admission import (
    BODY_COPIES,
    Budget,
    Lease,
    default_budget,
    default_request_memory,
    prep_cost,
)
from kestrel_cli.server.events import Answer, Content, Finish, Reasoning, Token
from kestrel_cli.server.models import (
    COMPLETIONS_MAX_TOKENS,
    APIError,
    ChatRequest,
    Options,
    check_unsupported,
    content_chars,
    first_bad_string,
    parse_prompt,
)
from kestrel_cli.server.scheduler import Job, Scheduler, Ticket
from kestrel_cli.text.reasoning import prompt_opens_thinking
from kestrel_cli.text.tokenizer import TooManyTokens

log = logging.getLogger("kestrel.server")

MAX_BODY_BYTES = 32 << 20  # larger request bodies get 413
RETRY_AFTER_S = 1  # 503 server_busy's Retry-After: a request or a slot frees soon
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


@dataclasses.dataclass
class Limits:
    """What one client may hold, in seconds and counts (`kestrel serve` flags; README:
    "Running it safely")."""

    header_timeout: float = 10.0  # a request's line and headers, from its first byte
    body_timeout: float = 30.0  # its body, from the end of the headers (-> 408)
    keep_alive: float = 5.0  # an idle connection between requests
    request_timeout: float = 600.0  # one generation, from admission to last token (-> 504)
    max_connections: int = 64  # open connections; one more gets 503 and is closed
    schema_timeout: float = 5.0  # compiling a response_format / tool schema (-> 400)
    shutdown_timeout: float = 5.0  # SIGTERM: in-flight replies get this long, then 503
    # bytes requests may hold while read and prepared (admission.py): all at once (-> 503
    # server_busy), one request (-> 413); None: admission's defaults for this machine
    memory_budget: int | None = None
    max_request_memory: int | None = None

    def budget(self) -> Budget:
        total = self.memory_budget or default_budget()
        return Budget(total, self.max_request_memory or default_request_memory(total))


# ---------------------------------------------------------------------------- replies


def _usage(stats: Stats) -> dict:
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.generated_tokens,
        "total_tokens": stats.prompt_tokens + stats.generated_tokens,
        "prompt_tokens_details": {"cached_tokens": stats.cached_tokens},
    }


def _timings(stats: Stats, gen_ms: float) -> dict:
    """llama-server's `timings`: prompt_* count only the tokens prefilled (not cache_n);
    predicted_* the tokens sampled, over the time from the end of prefill to the last;
    draft_n / draft_n_accepted the draft model's proposed and accepted tokens."""
    pn, pms, gn, gms = stats.prefill_tokens, stats.prefill_ms, stats.generated_tokens, gen_ms
    return {
        "cache_n": stats.cached_tokens,
        "prompt_n": pn,
        "prompt_ms": round(pms, 3),
        "prompt_per_token_ms": round(pms / pn, 3) if pn else 0.0,
        "prompt_per_second": round(pn / pms * 1e3, 3) if pms > 0 else 0.0,
        "predicted_n": gn,
        "predicted_ms": round(gms, 3),
        "predicted_per_token_ms": round(gms / gn, 3) if gn else 0.0,
        "predicted_per_second": round(gn / gms * 1e3, 3) if gms > 0 else 0.0,
        # speculative decoding (--draft), as llama-server: only when a draft proposed tokens
        **(
            {"draft_n": stats.draft_tokens, "draft_n_accepted": stats.draft_accepted}
            if stats.draft_tokens
            else {}
        ),
    }


def _error_response(err: APIError, path: str = "") -> JSONResponse:
    """`err` as a reply in the shape of the API whose route `path` is (Anthropic's under
    /v1/messages, OpenAI's elsewhere); a 503 server_busy says when to retry (clients such as
    the OpenAI and Anthropic SDKs wait that long before their next try)."""
    if anthropic.is_anthropic(path):
        resp = JSONResponse(anthropic.error_body(err), status_code=err.status)
    else:
        resp = err.response()
    if err.code == "server_busy":
        resp.headers["Retry-After"] = str(RETRY_AFTER_S)
    return resp


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


class _Stream(StreamingResponse):
    """Server-sent events whose job is cancelled however the response ends: client gone,
    server shutting down, or an error."""

    def __init__(self, content, on_close, **kw):
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            **kw,
        )
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


def check_api_key(api_key: str | None) -> None:
    """An empty key is a mistake (`--api-key "$KEY"` with KEY unset), not a request to serve
    without one."""
    if api_key is not None and not api_key.strip():
        raise KestrelError(
            "--api-key (or KESTREL_API_KEY) is empty: give a key, or leave it "
            "out to serve without one"
        )


def valid_filename(name) -> bool:
    """A slot file's name (llama-server's rules, a subset): a plain file name of at most
    255 bytes, no path separator, no "..", no control character, not starting with "."."""
    return (
        isinstance(name, str)
        and 0 < len(name.encode("utf-8", "replace")) <= 255
        and name == name.strip()
        and not name.startswith(".")
        and ".." not in name
        and not any(c in name for c in "/\\:")
        and all(ord(c) >= 32 and ord(c) != 127 for c in name)
    )


def _save(engine: Engine, path: Path) -> tuple[int, int]:
    try:
        return engine.save_cache(path)
    except KestrelError as e:
        raise APIError(str(e), 400) from None
    except OSError as e:
        raise APIError(f"cannot save {path.name}: {e.strerror or e}", 500) from None


def _erase(engine: Engine) -> int:
    n = len(engine.cached_ids)
    engine.reset()
    return n


def model_id(engine: Engine) -> str:
    return Path(str(engine.path)).name or str(engine.path)


def create_app(
    engines: list[Engine],
    api_key: str | None = None,
    queue_size: int = 32,
    limits: Limits | None = None,
    slot_save_path: str | Path | None = None,
    reasoning_budget: int = -1,
    response_store: responses.ResponseStore | None = None,
) -> FastAPI:
    """The FastAPI app serving `engines` (one per slot, sharing weights and tokenizer);
    with `slot_save_path`, POST /slots/{id}?action=save|restore|erase (llama-server's) save
    a slot's KV cache to a file of that directory and load it back. `reasoning_budget` is
    the thinking budget of a request that sets none (-1: unlimited). `response_store` keeps
    /v1/responses' stored responses (default: a ResponseStore with its default bounds)."""
    from contextlib import asynccontextmanager

    check_api_key(api_key)
    limits = limits or Limits()
    # several slots: their sequences decoded together by one batch thread
    sched = Scheduler(
        engines, queue_size, Batcher(engines[0].fork().model) if len(engines) > 1 else None
    )
    budget = limits.budget()
    eng0 = engines[0]
    mid, created = model_id(eng0), int(time.time())
    fingerprint = f"kestrel-{__version__}"

    @asynccontextmanager
    async def lifespan(app):
        sched.start()
        yield
        await sched.close()

    app = FastAPI(
        title="kestrel",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        redirect_slashes=False,
    )  # "/v1/models/" is a 404
    app.state.scheduler = sched
    app.state.limits = limits
    app.state.budget = budget
    store = response_store if response_store is not None else responses.ResponseStore()
    app.state.response_store = store

    # -- cross-cutting: errors, auth, one log line per request
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        request.scope["kestrel.error"] = exc.message
        return _error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc):
        return _error_response(APIError(str(exc.detail), exc.status_code), request.url.path)

    @app.exception_handler(Exception)
    async def _crash(request, exc):
        log.exception("unhandled error")
        err = APIError(f"internal error: {type(exc).__name__}", 500)
        return _error_response(err, request.url.path)

    async def read_json(request: Request) -> dict:
        """The body as a JSON object; its bytes are taken from the request's lease as they
        arrive (held, joined and parsed: BODY_COPIES times), so bodies in flight are bounded
        by the memory budget as well as by MAX_BODY_BYTES each."""
        size = 0
        parts = []
        lease = lease_of(request)
        try:
            async for part in request.stream():
                size += len(part)
                if size > MAX_BODY_BYTES:
                    raise APIError(f"request body larger than {MAX_BODY_BYTES >> 20} MiB", 413)
                lease.add(BODY_COPIES * len(part), "the request body")
                parts.append(part)
        except ClientDisconnect:
            raise APIError("the client went away before sending the whole body", 400) from None
        raw = b"".join(parts)

        def no_constant(name):
            raise ValueError(f"{name} is not valid JSON")

        try:
            body = json.loads(raw, parse_constant=no_constant)
        except (ValueError, RecursionError) as e:
            raise APIError(f"malformed JSON body: {e}", 400) from None
        if not isinstance(body, dict):
            raise APIError("the request body must be a JSON object", 400)
        if _SURROGATE_ESCAPE.search(raw) and (where := first_bad_string(body)) is not None:
            where = clip(where, 200)  # a path through long or deep keys is the client's
            raise APIError(
                f"'{where}' holds a lone UTF-16 surrogate (an unpaired \\ud800-"
                f"\\udfff escape), which is not valid Unicode",
                400,
                param=where,
            )
        return body

    def lease_of(request: Request) -> Lease:
        """The request's share of the memory budget (made by _FrontDoor, given back when the
        reply has been sent)."""
        return request.scope["kestrel.lease"]

    async def admit(
        request: Request,
        ids: list[int],
        params: dict,
        param: str,
        cache_prompt: bool,
        ticket: Ticket | None = None,
    ) -> Job:
        if len(ids) >= eng0.ctx_size:
            raise APIError(
                f"the prompt has {len(ids)} tokens, and the context size is "
                f"{eng0.ctx_size}: no room for an answer (start the server with a "
                f"larger -c/--ctx-size)",
                400,
                param=param,
                code="context_length_exceeded",
            )
        if not ids:
            raise APIError("empty prompt", 400, param=param)
        # max_tokens is capped by the room the context has left (finish_reason "length")
        params = {**params, "max_tokens": min(params["max_tokens"], eng0.ctx_size - len(ids))}
        # its KV cache must fit the memory available now (on the slot holding the least)
        tokens = len(ids) + params["max_tokens"]
        short = kv_memory.request_shortfall(engines, tokens)
        if short is not None:
            raise APIError(
                kv_memory.shortfall_text(
                    tokens,
                    *short,
                    "a smaller max_tokens, or a server started with a smaller -c/--ctx-size",
                ),
                413,
                param="max_tokens",
                code="request_too_large",
            )
        job = Job(
            ids,
            params,
            asyncio.get_running_loop(),
            cache_prompt,
            timeout=limits.request_timeout or None,
        )
        request.scope["kestrel.job"] = job
        sched.submit(job, ticket)
        return job

    # a prompt longer than this cannot fit the context: refused before it is rendered or tokenised
    max_chars = eng0.tokenizer.max_text_chars(eng0.ctx_size)

    def bound_prompt(n_chars: int, param: str) -> None:
        if n_chars > max_chars:
            raise APIError(
                f"the prompt has {n_chars} characters, more than a context of "
                f"{eng0.ctx_size} tokens can hold (start the server with a larger "
                f"-c/--ctx-size)",
                400,
                param=param,
                code="context_length_exceeded",
            )

    async def encode(prompt, param: str, **kw) -> list[int]:
        """Template and tokeniser run in a worker thread: the event loop keeps serving. A
        prompt with no room left for an answer is refused once that is certain, without
        tokenising the rest of it."""
        try:
            return await asyncio.to_thread(
                eng0.encode_prompt, prompt, limit=eng0.ctx_size - 1, **kw
            )
        except TooManyTokens as e:
            raise APIError(
                f"the prompt has {'' if e.exact else 'at least '}{e.n_tokens} "
                f"tokens, and the context size is {eng0.ctx_size}: no room for an "
                f"answer (start the server with a larger -c/--ctx-size)",
                400,
                param=param,
                code="context_length_exceeded",
            ) from None
        except KestrelError as e:
            raise APIError(str(e), 400, param=param) from None

    def finish_log(request: Request, job: Job, stats: Stats | None, finish: str) -> None:
        request.scope["kestrel.log"] = (job, stats, finish)

    @functools.lru_cache(maxsize=65536)
    def tok_text(t: int) -> str:
        try:
            return eng0.tokenizer.decode([t])
        except KestrelError:  # a padding row of the embeddings, past the tokenizer's vocab
            return ""

    def lp_entry(t: int, lp: float) -> dict:
        s = tok_text(t)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    def chat_logprobs(chunks) -> dict:
        """OpenAI's chat `logprobs` of the tokens of `chunks`."""
        return {
            "content": [
                {
                    **lp_entry(c.token, c.logprob[0]),
                    "top_logprobs": [lp_entry(t, v) for t, v in c.logprob[1]],
                }
                for c in chunks
            ]
        }

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

    def chat_delta(ev, calls: list) -> dict:
        """A text or tool call event -> OpenAI's chat delta (tool calls given ids)."""
        if isinstance(ev, Reasoning):
            return {"reasoning_content": ev.text}
        if isinstance(ev, Content):
            return {"content": ev.text}
        call = {
            "index": ev.index,
            "id": "call_" + secrets.token_hex(12),
            "type": "function",
            "function": {"name": ev.name, "arguments": ev.arguments},
        }
        calls.append(call)
        return {"tool_calls": [call]}

    async def collect(request: Request, answer: Answer) -> tuple[list, Finish] | None:
        """All of a non-streamed answer's events but the Finish, and the Finish; None when
        the client went away first (its job is cancelled as soon as that is seen)."""
        job = answer.job
        watch = asyncio.create_task(_wait_disconnect(request.receive))
        watch.add_done_callback(lambda t: t.cancelled() or sched.cancel(job))
        evs, fin = [], None
        try:
            async for ev in answer.events():
                if isinstance(ev, Finish):
                    fin = ev
                else:
                    evs.append(ev)
        finally:
            watch.cancel()
            if fin is None:  # client gone, error or shutdown
                sched.cancel(job)
        return None if fin is None else (evs, fin)

    def stream_reply(request: Request, job: Job, body) -> _Stream:
        """Server-sent events from the async generator `body`; the job is cancelled if the
        stream ends before it does."""

        def on_close():
            if job.state != "done":
                sched.cancel(job)
                request.scope.setdefault("kestrel.log", (job, None, "cancelled"))

        return _Stream(body, on_close)

    async def generate(
        request: Request,
        answer: Answer,
        stream: bool,
        include_usage: bool,
        kind: str,
    ):
        """The OpenAI reply to an admitted answer: one JSON object, or SSE chunks. A chat
        answer's events become reasoning_content, content and tool_calls."""
        job = answer.job
        calls: list[dict] = []
        want_lp = job.params.get("logprobs") is not None
        rid = ("chatcmpl-" if kind == "chat" else "cmpl-") + secrets.token_hex(12)
        obj = "chat.completion" if kind == "chat" else "text_completion"
        if stream and kind == "chat":
            obj = "chat.completion.chunk"
        head = {
            "id": rid,
            "object": obj,
            "created": int(time.time()),
            "model": mid,
            "system_fingerprint": fingerprint,
        }

        if not stream:
            got = await collect(request, answer)
            if got is None:  # cancelled: the client is gone
                finish_log(request, job, None, "cancelled")
                return JSONResponse({}, status_code=499)
            evs, fin = got
            scored = [e.chunk for e in evs if isinstance(e, Token) and e.chunk.logprob is not None]
            finish = fin.reason
            if answer.split is not None:
                deltas = [chat_delta(e, calls) for e in evs if not isinstance(e, Token)]
                msg = {
                    "role": "assistant",
                    "content": "".join(d.get("content", "") for d in deltas),
                }
                reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
                if reasoning:
                    msg["reasoning_content"] = reasoning
                if calls:
                    msg["content"] = msg["content"] or None
                    msg["tool_calls"] = [
                        {k: c[k] for k in ("id", "type", "function")} for c in calls
                    ]
                    finish = "tool_calls"
                choice = {"index": 0, "message": msg}
            else:
                text = "".join(e.text for e in evs if isinstance(e, Content))
                choice = (
                    {"index": 0, "message": {"role": "assistant", "content": text}}
                    if kind == "chat"
                    else {"index": 0, "text": text}
                )
            lps = None
            if want_lp:
                lps = chat_logprobs(scored) if kind == "chat" else completion_logprobs(scored, 0)
            choice.update(logprobs=lps, finish_reason=finish)
            finish_log(request, job, fin.stats, fin.reason)
            return JSONResponse(
                {
                    **head,
                    "choices": [choice],
                    "usage": _usage(fin.stats),
                    "timings": _timings(fin.stats, job.gen_ms),
                }
            )

        scored: list = []  # tokens whose logprobs no event has carried yet
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
            c = (
                {"index": 0, "delta": delta_or_text}
                if kind == "chat"
                else {"index": 0, "text": delta_or_text}
            )
            c.update(logprobs=take_logprobs() if scored or finish else None, finish_reason=finish)
            out = {**head, "choices": [c], **extra}
            if include_usage:
                out["usage"] = None
            return out

        async def events():
            fin = None
            if kind == "chat":
                yield _sse(chunk({"role": "assistant", "content": ""}))
            try:
                async for ev in answer.events():
                    if isinstance(ev, Token):
                        if ev.chunk.logprob is not None:
                            scored.append(ev.chunk)
                    elif isinstance(ev, Finish):
                        fin = ev
                    elif kind == "chat":
                        yield _sse(chunk(chat_delta(ev, calls)))
                    else:
                        yield _sse(chunk(ev.text))
            except APIError as e:  # an engine error, the time limit, shutdown
                finish_log(request, job, None, "error")
                request.scope["kestrel.error"] = e.message
                yield _sse(e.body())
                yield "data: [DONE]\n\n"
                return
            if fin is None:
                finish_log(request, job, None, "cancelled")
                return
            finish_log(request, job, fin.stats, fin.reason)
            yield _sse(
                chunk(
                    {} if kind == "chat" else "",
                    "tool_calls" if calls else fin.reason,
                    timings=_timings(fin.stats, job.gen_ms),
                )
            )
            if include_usage:
                yield _sse(
                    {
                        **head,
                        "choices": [],
                        "usage": _usage(fin.stats),
                        "timings": _timings(fin.stats, job.gen_ms),
                    }
                )
            yield "data: [DONE]\n\n"

        return stream_reply(request, job, events())

    # -- routes
    @app.get("/health")
    async def health():
        h = sched.health()
        return JSONResponse(h, status_code=503 if sched.closing else 200)

    @app.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": mid,
                    "object": "model",
                    "created": created,
                    "owned_by": "kestrel",
                    "meta": {
                        "architecture": eng0.config.model_type,
                        "n_ctx": eng0.ctx_size,
                        "n_vocab": eng0.config.vocab_size,
                        "parallel": len(engines),
                    },
                }
            ],
        }

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name != mid:
            raise APIError(
                f"model {name!r} not found; this server has {mid!r}",
                404,
                param="model",
                code="model_not_found",
            )
        return {"id": mid, "object": "model", "created": created, "owned_by": "kestrel"}

    def forced_schema(tools: list[dict], name: str) -> tuple[dict, str]:
        """(schema, text after it) of a forced call: a named function's arguments then the
        call's closing "}"; for 'required' the whole {"name", "arguments"} of one tool."""
        params = {
            t["function"]["name"]: t["function"].get("parameters") or {"type": "object"}
            for t in tools
        }
        if name:
            return params[name], "}"
        return {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": n}, "arguments": p},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for n, p in params.items()
            ]
        }, ""

    async def start(
        request: Request,
        opts: Options,
        prompt,
        param: str,
        kind: str,
        forced: str | None = None,
        ticket: Ticket | None = None,
        **kw,
    ) -> Answer:
        """Template, tokenise and admit a request: its Answer (the job, and how to split
        its text)."""
        ids = await encode(prompt, param, **kw)
        split, prefix = None, ""
        if kind == "chat":
            try:
                tail = eng0.tokenizer.decode([int(t) for t in ids[-4:]])
            except (TypeError, ValueError):  # a vision prompt
                tail = ""
            split = dict(
                thinking=True,
                in_thinking=prompt_opens_thinking(tail),
                tools=kw.get("tools") is not None,
            )
            if forced is not None:  # tool_choice required / a named function
                prefix = "<tool_call>\n" + (
                    f'{{"name": {json.dumps(forced)}, "arguments": ' if forced else ""
                )
                if split["in_thinking"]:
                    prefix = "</think>\n\n" + prefix
                ids = list(ids) + eng0.tokenizer.encode(prefix)
        default_max = eng0.ctx_size if kind == "chat" else COMPLETIONS_MAX_TOKENS
        params = opts.sampling(default_max)
        if params.get("reasoning_budget") is None:
            params["reasoning_budget"] = reasoning_budget
        suffix = ""
        if forced is not None:  # the call's JSON enforced while sampling
            params["json_schema"], params["json_then"] = forced_schema(kw["tools"], forced)
            suffix = "\n</tool_call>"
        job = await admit(request, ids, params, param, opts.cache_prompt, ticket)
        return Answer(job, split, prefix, suffix, decode=eng0.tokenizer.decode)

    async def answer(request: Request, opts: Options, prompt, param: str, kind: str, **kw):
        """The OpenAI reply to a chat or completion request."""
        ans = await start(request, opts, prompt, param, kind, **kw)
        return await generate(request, ans, opts.stream, opts.include_usage, kind)

    async def size_images(parts: list[dict], videos: list[dict] = ()) -> list[tuple[int, int]]:
        """(decode_cost, patch_bytes) of each image and video, from its header alone (base64
        decoded, no pixel, no frame): a bad or oversized image or video, or ones whose tokens
        leave no room in the context, are refused here, before the template runs or any of
        them is decoded."""
        from kestrel_cli.models.video import probe_video

        def probe():
            cfg = eng0.image_config()  # KestrelError: no vision tower
            heads = [probe_image(q["image"]) for q in parts]
            vcfg = eng0.video_config() if videos else None
            vheads = [probe_video(q["video"]) for q in videos]
            return cfg, heads, vcfg, [(h, vcfg.plan(h)) for h in vheads]

        try:
            cfg, heads, vcfg, plans = await asyncio.to_thread(probe)
        except KestrelError as e:
            raise APIError(str(e), 400, param="messages") from None
        n = sum(cfg.tokens_for(h.width, h.height) for h in heads)
        n += sum(plan.n_tokens for _, plan in plans)
        if n >= eng0.ctx_size:
            what = " and ".join(
                [f"{len(heads)} image(s)"] * bool(heads) + [f"{len(plans)} video(s)"] * bool(plans)
            )
            raise APIError(
                f"the prompt's {what} take {n} tokens, and the "
                f"context size is {eng0.ctx_size}: no room for an answer (start the "
                f"server with a larger -c/--ctx-size, or send smaller images or shorter videos)",
                400,
                param="messages",
                code="context_length_exceeded",
            )
        return [
            (cfg.decode_cost(h.width, h.height, h.format), cfg.patch_bytes(h.width, h.height))
            for h in heads
        ] + [(vcfg.decode_cost(h, plan), vcfg.patch_bytes(plan)) for h, plan in plans]

    async def check_schema(schema: dict, param: str = "response_format") -> None:
        """A schema llguidance cannot compile (or not within limits.schema_timeout) is the
        request's error (400), found early."""
        from kestrel_cli.text.constrained import JsonConstraint, _ll_tokenizer

        try:
            # the model's llguidance tokenizer, built once (seconds), is not the schema's time
            await asyncio.to_thread(_ll_tokenizer, eng0)
            await asyncio.wait_for(
                asyncio.to_thread(JsonConstraint, eng0, schema), limits.schema_timeout
            )
        except KestrelError as e:
            raise APIError(str(e), 400, param=param) from None
        except asyncio.TimeoutError:
            raise APIError(
                f"the JSON schema did not compile within {limits.schema_timeout:g} s",
                400,
                param=param,
            ) from None

    @app.post("/slots/{id_slot}")
    async def slots_action(request: Request, id_slot: str, action: str = ""):
        if slot_save_path is None:
            raise APIError(
                "This server does not support slots action. Start it with `--slot-save-path`",
                501,
                type="not_supported_error",
            )
        try:
            index = int(id_slot)
        except ValueError:
            raise APIError(f"invalid slot id {id_slot!r}", 400) from None
        if action not in ("save", "restore", "erase"):
            raise APIError(
                f"invalid action {action!r}: save, restore or erase", 400, param="action"
            )
        if action == "erase":
            n = await sched.on_idle_slot(index, _erase)
            return JSONResponse({"id_slot": index, "n_erased": n})
        body = await read_json(request)
        name = body.get("filename")
        if not valid_filename(name):
            raise APIError("Invalid filename", 400, param="filename")
        path = Path(slot_save_path) / name
        t0 = time.perf_counter()
        if action == "save":
            n, size = await sched.on_idle_slot(index, functools.partial(_save, path=path))
            ms = (time.perf_counter() - t0) * 1e3
            return JSONResponse(
                {
                    "id_slot": index,
                    "filename": name,
                    "n_saved": n,
                    "n_written": size,
                    "timings": {"save_ms": round(ms, 3)},
                }
            )
        if not path.is_file():
            raise APIError(f"no saved slot file {name!r}", 404, param="filename")

        def restore(e: Engine):
            try:
                return e.load_cache(path)
            except KestrelError as err:
                raise APIError(str(err).replace(str(path), name), 400) from None

        n, size = await sched.on_idle_slot(index, restore)
        ms = (time.perf_counter() - t0) * 1e3
        return JSONResponse(
            {
                "id_slot": index,
                "filename": name,
                "n_restored": n,
                "n_read": size,
                "timings": {"restore_ms": round(ms, 3)},
            }
        )

    def media_parts(messages: list, kind: str, most: int, noun: str) -> list:
        """The content parts of one kind ("image", "video") in the messages, at most `most`
        (more: a 400)."""
        found = [
            q
            for m in messages
            if isinstance(m["content"], list)
            for q in m["content"]
            if q["type"] == kind
        ]
        if len(found) > most:
            raise APIError(
                f"{len(found)} {noun} in one request, more than {most}", 400, param="messages"
            )
        return found

    async def chat_answer(request: Request, req: ChatRequest, count_only: bool = False):
        """The chat pipeline every chat API shares: bound the prompt, reserve a place, size
        the images, take the request's memory, check the schemas, then template, tokenise
        and admit: the Answer. `count_only`: the prompt's token count instead (nothing is
        admitted or generated)."""
        messages, tools, forced, opts = req.messages, req.tools, req.forced, req.opts
        kwargs, schema = dict(req.kwargs), req.schema
        if (reasoning_budget if opts.reasoning_budget is None else opts.reasoning_budget) == 0:
            kwargs.setdefault("enable_thinking", False)  # the template's empty think block
        # tools are rendered into the prompt too: their JSON counts against its size
        n_chars = sum(content_chars(m["content"]) for m in messages) + (
            len(json.dumps(tools)) if tools is not None else 0
        )
        bound_prompt(n_chars, "messages")
        parts = media_parts(messages, "image", MAX_IMAGES_PER_PROMPT, "images")
        videos = media_parts(messages, "video", MAX_VIDEOS_PER_PROMPT, "videos")
        # admitted (a place, then memory) before any template, tokeniser, image or grammar work
        ticket = sched.reserve()
        try:
            images = await size_images(parts, videos) if parts or videos else []
            grammars = 0 if count_only else (schema is not None) + (forced is not None)
            lease_of(request).add(
                prep_cost(n_chars, eng0.ctx_size, images, grammars), "the request"
            )
            if schema is not None:
                if not count_only:
                    await check_schema(schema, req.schema_param)
                if "enable_thinking" not in kwargs:
                    kwargs["enable_thinking"] = False  # the answer is JSON from its first token
            if tools is not None:
                kwargs["tools"] = tools
            if count_only:
                ids = await encode(messages, "messages", max_chars=max_chars, **kwargs)
                return len(ids)
            if forced is not None:
                await check_schema(forced_schema(tools, forced)[0], "tools")
            return await start(
                request,
                opts,
                messages,
                "messages",
                "chat",
                forced=forced,
                ticket=ticket,
                max_chars=max_chars,
                **kwargs,
            )
        finally:
            ticket.release()  # not queued: the preparation failed

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = ChatRequest.parse(await read_json(request))
        ans = await chat_answer(request, req)
        return await generate(request, ans, req.opts.stream, req.opts.include_usage, "chat")

    def stream_done(request: Request, job: Job):
        """How a stream of another API's events reports its end to the request's log line:
        done(finish, error); both None: cancelled."""

        def done(fin: Finish | None, err: APIError | None) -> None:
            if err is not None:
                finish_log(request, job, None, "error")
                request.scope["kestrel.error"] = err.message
            elif fin is None:
                finish_log(request, job, None, "cancelled")
            else:
                finish_log(request, job, fin.stats, fin.reason)

        return done

    # -- Anthropic's Messages API
    async def finished(request: Request, ans):
        """A non-streamed answer whole, logged: (events, finish), or None when the client
        went away (logged as cancelled)."""
        got = await collect(request, ans)
        if got is None:
            finish_log(request, ans.job, None, "cancelled")
            return None
        finish_log(request, ans.job, got[1].stats, got[1].reason)
        return got

    @app.post("/v1/messages")
    async def messages(request: Request):
        req = anthropic.parse_request(await read_json(request))
        ans = await chat_answer(request, req)
        job = ans.job
        if req.opts.stream:
            return stream_reply(request, job, anthropic.stream(mid, ans, stream_done(request, job)))
        got = await finished(request, ans)
        if got is None:  # cancelled: the client is gone
            return JSONResponse({}, status_code=499)
        return JSONResponse(anthropic.message(mid, *got))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        req = anthropic.parse_request(await read_json(request), count_only=True)
        return JSONResponse({"input_tokens": await chat_answer(request, req, count_only=True)})

    # -- OpenAI's Responses API
    def count_text(text: str) -> int:
        return len(eng0.tokenizer.encode(text, add_special_tokens=False))

    @app.post("/v1/responses")
    async def create_response(request: Request):
        req = responses.parse_request(await read_json(request), store)
        ans = await chat_answer(request, req.chat)
        job = ans.job
        b = responses.Builder(mid, req, count_text)

        def keep(resp: dict) -> None:
            if req.echo["store"]:
                store.put(b.id, resp, b.history())

        if req.chat.opts.stream:
            events = responses.stream(b, ans, stream_done(request, job), keep)
            return stream_reply(request, job, events)
        got = await finished(request, ans)
        if got is None:  # cancelled: the client is gone
            return JSONResponse({}, status_code=499)
        resp = b.whole(*got)
        keep(resp)
        return JSONResponse(resp)

    @app.get("/v1/responses/{rid}")
    async def get_response(rid: str):
        got = store.get(rid)
        if got is None:
            raise responses.not_found(rid)
        return JSONResponse(got[0])

    @app.delete("/v1/responses/{rid}")
    async def delete_response(rid: str):
        if not store.delete(rid):
            raise responses.not_found(rid)
        return JSONResponse({"id": rid, "object": "response", "deleted": True})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await read_json(request)
        check_unsupported(body)
        prompt = parse_prompt(body)
        opts = Options.parse(body)
        n_chars = len(prompt) if isinstance(prompt, str) else 0
        bound_prompt(n_chars, "prompt")
        ticket = sched.reserve()
        try:
            lease_of(request).add(prep_cost(n_chars, eng0.ctx_size), "the request")
            return await answer(request, opts, prompt, "prompt", "completion", ticket=ticket)
        finally:
            ticket.release()

    app.add_middleware(_FrontDoor, api_key=api_key, body_timeout=limits.body_timeout, budget=budget)
    return app


class _FrontDoor:
    """Plain ASGI middleware (no buffering, so streams and disconnects pass through):
    checks the API key on /v1/*, bounds the time the request body may take to arrive
    (408), then logs one line per request with status, tokens and time (the handlers
    leave `kestrel.log` = (job, stats, finish) in the scope)."""

    def __init__(
        self, app, budget: Budget, api_key: str | None = None, body_timeout: float | None = None
    ):
        self.app, self.api_key, self.body_timeout = app, api_key, body_timeout
        self.budget = budget

    def _deadline_receive(self, receive):
        """`receive`, raising APIError 408 once the body has taken body_timeout seconds."""
        if not self.body_timeout:
            return receive
        loop = asyncio.get_running_loop()
        deadline, done = loop.time() + self.body_timeout, [False]

        async def receive_():
            if done[0]:
                return await receive()
            try:
                msg = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except asyncio.TimeoutError:
                raise APIError(
                    f"the request body did not arrive within {self.body_timeout:g} s",
                    408,
                    code="request_timeout",
                ) from None
            if msg["type"] != "http.request" or not msg.get("more_body"):
                done[0] = True
            return msg

        return receive_

    def _authorized(self, scope) -> bool:
        """One credential, with the key: an `Authorization: Bearer KEY` header (OpenAI's
        clients) or an `x-api-key: KEY` header (Anthropic's). A request carrying two (a
        wrong one and a right one) is refused, whichever a proxy would have read."""
        if self.api_key is None or not scope["path"].startswith("/v1/"):
            return True
        creds = []
        for k, v in scope.get("headers") or []:
            k = k.lower()
            if k == b"authorization":
                scheme, _, token = v.decode("latin-1").partition(" ")
                creds.append(token.strip() if scheme.lower() == "bearer" else "")
            elif k == b"x-api-key":
                creds.append(v.decode("latin-1").strip())
        if len(creds) != 1 or not creds[0]:
            return False
        return hmac.compare_digest(creds[0].encode("latin-1"), self.api_key.encode())

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = [None]
        lease = scope["kestrel.lease"] = self.budget.lease()

        async def send_(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            if self._authorized(scope):
                await self.app(scope, self._deadline_receive(receive), send_)
            else:
                err = APIError(
                    "invalid or missing API key (send one 'Authorization: Bearer KEY' or "
                    "'x-api-key: KEY' header)",
                    401,
                    code="invalid_api_key",
                )
                await _error_response(err, scope["path"])(scope, receive, send_)
        finally:
            lease.release()
            self._line(scope, status[0], t0)

    @staticmethod
    def _line(scope, status, t0) -> None:
        ms = (time.perf_counter() - t0) * 1e3
        client = scope.get("client")
        who = f"{client[0]}:{client[1]}" if client else "-"
        parts = [who, f'"{scope["method"]} {scope["path"]}"', str(status or "-")]
        job, stats, finish = scope.get("kestrel.log", (scope.get("kestrel.job"), None, None))
        if stats is not None:
            parts.append(
                f"prompt={stats.prompt_tokens} cached={stats.cached_tokens} "
                f"completion={stats.generated_tokens}"
            )
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


def _raw_error(err: APIError) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection, for the protocol level
    (before any ASGI app runs)."""
    body = json.dumps(err.body()).encode()
    reason = {408: b"Request Timeout", 503: b"Service Unavailable"}.get(err.status, b"Error")
    retry = b"retry-after: %d\r\n" % RETRY_AFTER_S if err.code == "server_busy" else b""
    return (
        b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
        b"%sconnection: close\r\n\r\n" % (err.status, reason, len(body), retry)
    ) + body


class _Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the limits it lacks: a connection over
    --max-connections gets 503 and is closed; a request's line and headers must arrive
    within --timeout-header of its first byte (and a new connection must start one within
    that time), else 408 and close; a reply sent before its request's body was read ends the
    connection (a client trickling a body cannot keep it)."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._header_timer = None
        self._got_bytes = False
        limits: Limits = self.config.kestrel_limits
        if len(self.connections) > limits.max_connections:
            log.warning(
                f"refused a connection: {len(self.connections) - 1} open "
                f"(--max-connections {limits.max_connections})"
            )
            transport.write(
                _raw_error(
                    APIError(
                        f"too many open connections (the limit is {limits.max_connections}); retry "
                        f"later",
                        503,
                        code="server_busy",
                    )
                )
            )
            transport.close()
            return
        self._arm()

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(
                self.config.kestrel_limits.header_timeout, self._header_timeout
            )

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        self._got_bytes = True
        super().data_received(data)
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self._arm()  # a request has begun: its headers have a deadline
        else:
            self._disarm()

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            return
        if self._got_bytes:  # a partial request line or headers
            t = self.config.kestrel_limits.header_timeout
            self.transport.write(
                _raw_error(
                    APIError(
                        f"the request headers did not arrive within {t:g} s",
                        408,
                        code="request_timeout",
                    )
                )
            )
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._got_bytes = False
        if self.conn.their_state not in (h11.IDLE, h11.DONE) and not self.transport.is_closing():
            self.transport.close()  # the rest of its body is not waited for

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)


class _Server(uvicorn.Server):
    """uvicorn's server, telling the scheduler when SIGINT/SIGTERM arrives: queued requests
    get 503 at once, running ones --shutdown-timeout seconds to finish, then a 503 error
    (a stream: an error event and [DONE]); a second signal cuts them at once."""

    scheduler: Scheduler | None = None
    drain_timeout: float = 5.0

    def handle_exit(self, sig, frame) -> None:
        first = not self.should_exit
        super().handle_exit(sig, frame)
        loop, sched = getattr(self, "_loop", None), self.scheduler
        if sched is None or loop is None:
            return
        if first and not self.force_exit:
            loop.call_soon_threadsafe(sched.begin_shutdown, False)
            loop.call_soon_threadsafe(loop.call_later, self.drain_timeout, sched.abort_running)
        else:
            loop.call_soon_threadsafe(sched.begin_shutdown, True)

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)


def exposure_warning(host: str, api_key: str | None) -> str | None:
    """The warning due when `host` reaches beyond loopback and no API key is set."""
    if api_key:
        return None
    try:
        if ipaddress.ip_address(host.strip("[]")).is_loopback:
            return None
    except ValueError:  # a host name: only localhost is known to be local
        if host == "localhost":
            return None
    return (
        f"listening on {host}, beyond this machine's loopback, WITHOUT --api-key: anyone "
        f"who can reach this port can use the model; set --api-key (or KESTREL_API_KEY), "
        f"or bind 127.0.0.1"
    )


def _setup_logging() -> None:
    if log.handlers:
        return
    from uvicorn.logging import DefaultFormatter

    h = logging.StreamHandler()
    h.setFormatter(DefaultFormatter("%(levelprefix)s %(message)s"))
    log.addHandler(h)
    log.setLevel(logging.INFO)
    log.propagate = False


def serve(
    engines: list[Engine],
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    queue_size: int = 32,
    limits: Limits | None = None,
    slot_save_path: str | Path | None = None,
    reasoning_budget: int = -1,
) -> None:
    """Serve until SIGINT/SIGTERM; then in-flight requests get `limits.shutdown_timeout`
    seconds to finish before they are ended with a 503 error, queued ones get 503 at once,
    and this returns."""
    _setup_logging()
    limits = limits or Limits()
    app = create_app(
        engines,
        api_key=api_key,
        queue_size=queue_size,
        limits=limits,
        slot_save_path=slot_save_path,
        reasoning_budget=reasoning_budget,
    )
    # uvicorn's own graceful timeout is a backstop after ours: the aborted replies are sent
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        access_log=False,
        log_level="info",
        http=_Protocol,
        timeout_keep_alive=limits.keep_alive,
        timeout_graceful_shutdown=limits.shutdown_timeout + 3,
        lifespan="on",
    )
    config.kestrel_limits = limits
    server = _Server(config)
    server.scheduler, server.drain_timeout = app.state.scheduler, limits.shutdown_timeout
    eng = engines[0]
    log.info(
        f"model {model_id(eng)} ({eng.config.model_type}), context {eng.ctx_size}, "
        f"{len(engines)} slot(s) x {eng.threads} thread(s), queue {queue_size}"
        + (
            f", draft {eng.speculator.draft.path.name} (up to {eng.speculator.n_max} tokens)"
            if eng.speculator is not None
            else ""
        )
        + (", API key required" if api_key else "")
    )
    log.info(
        f"limits: {limits.max_connections} connections, headers {limits.header_timeout:g} s,"
        f" body {limits.body_timeout:g} s, keep-alive {limits.keep_alive:g} s, request "
        f"{limits.request_timeout:g} s, shutdown drain {limits.shutdown_timeout:g} s"
    )
    budget = app.state.budget
    log.info(
        f"memory for requests in preparation: memory budget {budget.total >> 20} MiB, "
        f"{budget.per_request >> 20} MiB a request"
    )
    warning = exposure_warning(host, api_key)
    if warning:
        log.warning(warning)
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
