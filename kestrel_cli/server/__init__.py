"""`kestrel serve`: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over the Engine.

Modules: `models` (requests: parsing, validation, the error shape), `scheduler` (the
slots, their worker threads and the queue: --parallel, --queue-size), `events` (an answer
as structured events: reasoning / content deltas, tool calls, finish), `anthropic` and
`responses` (those APIs' requests and replies over the same chat pipeline) and `app` (the
FastAPI routes, replies, logging and running uvicorn).

    GET  /health                 {"status", "slots_idle", "slots_processing", "requests_queued"}
    GET  /v1/models              the one loaded model (id = the model file or directory name)
    POST /v1/chat/completions    messages -> chat template -> reply (or SSE chunks)
    POST /v1/completions         raw prompt text (or token ids) -> continuation
    POST /v1/messages            Anthropic's Messages API (and /v1/messages/count_tokens)
    POST /v1/responses           OpenAI's Responses API; GET / DELETE /v1/responses/{id}

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

from kestrel_cli.core.errors import KestrelError

try:
    import fastapi  # noqa: F401
    import uvicorn  # noqa: F401
except ImportError as e:  # the [serve] extra is missing
    raise KestrelError(
        f"kestrel serve needs fastapi and uvicorn ({e.name} is missing): "
        "pip install 'kestrel-cli[serve]'"
    ) from None

from kestrel_cli.server.admission import parse_size  # noqa: E402
from kestrel_cli.server.app import (  # noqa: E402
    Limits,
    check_api_key,
    create_app,
    exposure_warning,
    model_id,
    serve,
)
from kestrel_cli.server.models import APIError  # noqa: E402
from kestrel_cli.server.responses import ResponseStore  # noqa: E402
from kestrel_cli.server.scheduler import Job, Scheduler, Slot  # noqa: E402

__all__ = [
    "APIError",
    "Job",
    "Limits",
    "ResponseStore",
    "Scheduler",
    "Slot",
    "check_api_key",
    "create_app",
    "exposure_warning",
    "model_id",
    "parse_size",
    "serve",
]
