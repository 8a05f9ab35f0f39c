"""OpenAI's Responses API (POST /v1/responses, GET and DELETE /v1/responses/{id}) over the
chat pipeline: the request becomes a ChatRequest (instructions, input items: messages,
function_call, function_call_output and reasoning items; function tools, tool_choice,
max_output_tokens, reasoning.effort, text.format), and the answer's events
(server/events.py) become a response object with reasoning, message and function_call
output items, or its server-sent events. Responses are kept (store, the default) in a
bounded in-memory ResponseStore, so that a later request's previous_response_id continues
the conversation. Errors have OpenAI's shape."""

from __future__ import annotations

import collections
import json
import secrets
import time
from typing import AsyncIterator, Callable

from kestrel_cli.server.events import Answer, Content, Finish, Reasoning, ToolCall
from kestrel_cli.server.models import (
    REASONING_EFFORTS,
    APIError,
    ChatRequest,
    Options,
    _short,
    is_int,
    parse_messages,
    parse_tools,
    unsupported,
)

# the store's bounds (README "The server"): the oldest responses go first once there are
# more than STORE_MAX_RESPONSES, or their JSON passes STORE_MAX_BYTES; any is gone after
# STORE_MAX_AGE_S seconds
STORE_MAX_RESPONSES = 256
STORE_MAX_AGE_S = 3600.0
STORE_MAX_BYTES = 64 << 20
EFFORTS = (*REASONING_EFFORTS, "xhigh")
_NO_THINKING = ("none", "minimal")  # reasoning efforts that turn Qwen3's thinking off


class ResponseStore:
    """Stored responses by id, each with the conversation it ends (the chat messages of its
    input, its history and its output): bounded in count, bytes and age."""

    def __init__(
        self,
        max_responses: int = STORE_MAX_RESPONSES,
        max_age_s: float = STORE_MAX_AGE_S,
        max_bytes: int = STORE_MAX_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_responses, self.max_age_s, self.max_bytes = max_responses, max_age_s, max_bytes
        self.clock = clock
        self._items: collections.OrderedDict[str, tuple[float, int, dict, list]] = (
            collections.OrderedDict()
        )
        self.nbytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._items)

    def _expire(self) -> None:
        now = self.clock()
        while self._items:
            rid, (t, n, _, _) = next(iter(self._items.items()))
            if now - t <= self.max_age_s:
                break
            self._drop(rid)

    def _drop(self, rid: str) -> None:
        _, n, _, _ = self._items.pop(rid)
        self.nbytes -= n

    def put(self, rid: str, response: dict, history: list[dict]) -> bool:
        """Keep `response` and the conversation it ends; False when it alone is larger than
        the store (it is not kept)."""
        n = len(json.dumps(response, ensure_ascii=False)) + len(
            json.dumps(history, ensure_ascii=False)
        )
        if n > self.max_bytes or self.max_responses < 1:
            return False
        self._expire()
        while self._items and (
            len(self._items) >= self.max_responses or self.nbytes + n > self.max_bytes
        ):
            self._drop(next(iter(self._items)))
        self._items[rid] = (self.clock(), n, response, history)
        self.nbytes += n
        return True

    def get(self, rid: str) -> tuple[dict, list[dict]] | None:
        """(response, conversation) of a stored response that has not expired, or None."""
        self._expire()
        got = self._items.get(rid)
        return None if got is None else (got[2], got[3])

    def delete(self, rid: str) -> bool:
        self._expire()
        if rid not in self._items:
            return False
        self._drop(rid)
        return True


def not_found(rid: str, param: str | None = None) -> APIError:
    return APIError(
        f"Response with id {_short(rid)} not found (never stored, deleted, or expired)",
        404,
        param=param,
        code="previous_response_not_found" if param else "response_not_found",
    )


# ---------------------------------------------------------------------------- requests


def _parts(content, param: str, role: str):
    """A message item's content -> chat content (a string, or text and image_url parts)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"'{param}' must be a string or an array of content parts", param=param)
    out = []
    for j, part in enumerate(content):
        q = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text", "text"):
            if not isinstance(part.get("text"), str):
                raise APIError(f"'{q}.text' must be a string", param=f"{q}.text")
            out.append({"type": "text", "text": part["text"]})
        elif kind == "refusal" and isinstance(part.get("refusal"), str):
            out.append({"type": "text", "text": part["refusal"]})
        elif kind == "input_image" and role == "user":
            url = part.get("image_url")
            if not isinstance(url, str):
                raise unsupported(
                    f"{q}.image_url", ": images are sent inline as a base64 data: URL"
                )
            out.append({"type": "image_url", "image_url": {"url": url}})
        elif isinstance(kind, str):
            raise unsupported(
                f"{q}.type",
                f": {role} content parts are input_text, output_text"
                + (" and input_image" if role == "user" else "")
                + f" (got {_short(kind)})",
            )
        else:
            raise APIError(f"'{q}' must be a content part (an object with a type)", param=q)
    return out


def _output_text(output, param: str) -> str:
    """A function_call_output's output: a string, or input_text parts (joined)."""
    if isinstance(output, str):
        return output
    if isinstance(output, list):
        texts = []
        for j, part in enumerate(output):
            if not isinstance(part, dict) or part.get("type") != "input_text":
                raise unsupported(f"{param}[{j}]", ": a function_call_output holds text only")
            if not isinstance(part.get("text"), str):
                raise APIError(f"'{param}[{j}].text' must be a string", param=f"{param}[{j}].text")
            texts.append(part["text"])
        return "\n".join(texts)
    raise APIError(f"'{param}' must be a string", param=param)


def input_messages(inp) -> list[dict]:
    """`input` -> chat messages (checked by parse_messages): message items; function_call
    items join the assistant message before them (or make one); function_call_output items
    are tool messages; a reasoning item's text is the next assistant message's
    reasoning_content."""
    if isinstance(inp, str):
        return parse_messages({"messages": [{"role": "user", "content": inp}]})
    if not isinstance(inp, list):
        raise APIError("'input' must be a string or an array of input items", param="input")
    out: list[dict] = []
    reasoning: list[str] = []

    def assistant() -> dict:
        if out and out[-1]["role"] == "assistant" and not reasoning:
            return out[-1]
        msg = {"role": "assistant", "content": ""}
        if reasoning:
            msg["reasoning_content"] = "\n".join(reasoning)
            reasoning.clear()
        out.append(msg)
        return msg

    for i, item in enumerate(inp):
        p = f"input[{i}]"
        if not isinstance(item, dict):
            raise APIError(f"'{p}' must be an object", param=p)
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise APIError(
                    f"'{p}.role' must be one of user, assistant, system, developer; got "
                    f"{_short(role)}",
                    param=f"{p}.role",
                )
            content = _parts(item.get("content"), f"{p}.content", role)
            if role == "assistant":
                text = content if isinstance(content, str) else "".join(q["text"] for q in content)
                msg = {"role": "assistant", "content": text}
                if reasoning:
                    msg["reasoning_content"] = "\n".join(reasoning)
                    reasoning.clear()
                out.append(msg)
            else:
                out.append({"role": role, "content": content})
        elif kind == "function_call":
            for k in ("call_id", "name", "arguments"):
                if not isinstance(item.get(k), str):
                    raise APIError(f"'{p}.{k}' is required (a string)", param=f"{p}.{k}")
            msg = assistant()
            msg.setdefault("tool_calls", []).append(
                {
                    "id": item["call_id"],
                    "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]},
                }
            )
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise APIError(f"'{p}.call_id' is required (a string)", param=f"{p}.call_id")
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": item["call_id"],
                    "content": _output_text(item.get("output"), f"{p}.output"),
                }
            )
        elif kind == "reasoning":
            parts = item.get("content") or []
            if not isinstance(parts, list):
                raise APIError(f"'{p}.content' must be an array", param=f"{p}.content")
            for j, c in enumerate(parts):
                if isinstance(c, dict) and isinstance(c.get("text"), str):
                    reasoning.append(c["text"])
                else:
                    raise APIError(
                        f"'{p}.content[{j}]' must be a reasoning_text part",
                        param=f"{p}.content[{j}]",
                    )
        elif isinstance(kind, str):
            raise unsupported(
                f"{p}.type",
                f": input items are messages, function_call, function_call_output and "
                f"reasoning (got {_short(kind)})",
            )
        else:
            raise APIError(f"'{p}.type' is required", param=f"{p}.type")
    return parse_messages({"messages": out}) if out else []


def _tools(body: dict) -> tuple[list[dict], list[dict] | None, str | None]:
    """tools and tool_choice -> (the tools as chat tools, those to render or None, the
    function a tool_choice forces: "" any, None none)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    chat_tools = None
    if tools is not None:
        if not isinstance(tools, list):
            raise APIError("'tools' must be an array", param="tools")
        chat_tools = []
        for j, t in enumerate(tools):
            p = f"tools[{j}]"
            if not isinstance(t, dict):
                raise APIError(f"'{p}' must be an object", param=p)
            if t.get("type") != "function":
                raise unsupported(
                    f"{p}.type", f": only function tools (got {_short(t.get('type'))})"
                )
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise APIError(f"'{p}.name' is required (a string)", param=f"{p}.name")
            fn = {"name": t["name"]}
            if isinstance(t.get("description"), str):
                fn["description"] = t["description"]
            if t.get("parameters") is not None:
                fn["parameters"] = t["parameters"]
            chat_tools.append({"type": "function", "function": fn})
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise APIError(
                '\'tool_choice\' must be none, auto, required or {"type": "function", "name": ...}',
                param="tool_choice",
            )
        if choice["name"] not in [t["function"]["name"] for t in chat_tools or []]:
            raise APIError(
                f"'tool_choice.name': {_short(choice['name'])} is not one of the tools",
                param="tool_choice.name",
            )
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return (chat_tools or [], *parse_tools({"tools": chat_tools, "tool_choice": choice}))


def _format(body: dict) -> dict | None:
    """text.format -> the chat pipeline's response_format (None: free text)."""
    text = body.get("text")
    if text is None:
        return None
    if not isinstance(text, dict):
        raise APIError("'text' must be an object", param="text")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise APIError("'text.format.schema' must be an object", param="text.format.schema")
        return {"type": "json_schema", "json_schema": {"schema": fmt["schema"]}}
    raise APIError(
        "'text.format.type' must be text, json_object or json_schema", param="text.format.type"
    )


def _format_echo(body: dict) -> dict:
    """The response's text.format: the request's, its known fields only (checked by
    _format already)."""
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    if fmt.get("type") != "json_schema":
        return {"type": fmt["type"]}
    out = {"type": "json_schema", "schema": fmt["schema"]}
    out["name"] = fmt["name"] if isinstance(fmt.get("name"), str) else "response"
    out["strict"] = fmt["strict"] if isinstance(fmt.get("strict"), bool) else None
    return out


def _choice_echo(forced: str | None, choice):
    """The response's tool_choice, from what the request forces."""
    if forced is None:
        return "none" if choice == "none" else "auto"
    return {"type": "function", "name": forced} if forced else "required"


class Request:
    """A parsed Responses request: the chat request, and what the response echoes or
    stores (the conversation before this request's input, the input's messages)."""

    def __init__(self, chat: ChatRequest, history: list[dict], new: list[dict], echo: dict):
        self.chat, self.history, self.new, self.echo = chat, history, new, echo


def parse_request(body: dict, store: ResponseStore) -> Request:
    for name, neutral in (
        ("background", lambda v: v is False),
        ("conversation", lambda v: False),
        ("prompt", lambda v: False),
        ("top_logprobs", lambda v: v == 0),
    ):
        if body.get(name) is not None and not neutral(body[name]):
            raise unsupported(name)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError("'model' must be a string", param="model")
    for name in ("store", "stream", "parallel_tool_calls"):
        if body.get(name) is not None and not isinstance(body[name], bool):
            raise APIError(f"'{name}' must be a boolean", param=name)
    max_out = body.get("max_output_tokens")
    if max_out is not None and (not is_int(max_out) or max_out < 1):
        raise APIError("'max_output_tokens' must be an integer >= 1", param="max_output_tokens")
    meta = body.get("metadata")
    if meta is not None and (
        not isinstance(meta, dict)
        or len(meta) > 16
        or not all(isinstance(v, str) for v in meta.values())
    ):
        raise APIError("'metadata' must be an object of at most 16 string values", param="metadata")
    instructions = body.get("instructions")
    if instructions is not None and not isinstance(instructions, str):
        raise APIError("'instructions' must be a string", param="instructions")
    prev = body.get("previous_response_id")
    history: list[dict] = []
    if prev is not None:
        if not isinstance(prev, str):
            raise APIError("'previous_response_id' must be a string", param="previous_response_id")
        got = store.get(prev)
        if got is None:
            raise not_found(prev, "previous_response_id")
        history = got[1]
    if body.get("input") is None and prev is None:
        raise APIError("'input' is required", param="input")
    new = input_messages(body.get("input") if body.get("input") is not None else [])
    messages = ([{"role": "system", "content": instructions}] if instructions else []) + (
        history + new
    )
    if not messages:
        raise APIError("'input' must hold at least one message", param="input")
    kwargs: dict = {}
    reasoning = body.get("reasoning")
    effort = None
    if reasoning is not None:
        if not isinstance(reasoning, dict):
            raise APIError("'reasoning' must be an object", param="reasoning")
        effort = reasoning.get("effort")
        if effort is not None:
            if effort not in EFFORTS:
                raise APIError(
                    f"'reasoning.effort' must be one of {', '.join(EFFORTS)}",
                    param="reasoning.effort",
                )
            kwargs["enable_thinking"] = effort not in _NO_THINKING
    given, tools, forced = _tools(body)
    fields = {k: body.get(k) for k in ("temperature", "top_p", "stream")}
    fields.update(max_tokens=max_out, response_format=_format(body))
    opts = Options.parse(fields)
    chat = ChatRequest(messages, tools, forced, opts, kwargs, opts.json_schema, "text.format")
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_out,
        "metadata": meta or {},
        "parallel_tool_calls": body.get("parallel_tool_calls", True) is not False,
        "previous_response_id": prev,
        "reasoning": {"effort": effort, "summary": None},
        "store": body.get("store") is not False,
        "temperature": opts.temperature,
        "text": {"format": _format_echo(body)},
        "tool_choice": _choice_echo(forced, body.get("tool_choice")),
        "tools": [
            {
                "type": "function",
                "name": t["function"]["name"],
                "description": t["function"].get("description"),
                "parameters": t["function"].get("parameters"),
                "strict": s if isinstance(s := raw.get("strict"), bool) else None,
            }
            for t, raw in zip(given, body.get("tools") or [])
        ],
        "top_p": opts.top_p,
        "truncation": "disabled",
    }
    return Request(chat, history, new, echo)


# ---------------------------------------------------------------------------- replies


def _id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class Builder:
    """A response object and its output items, built from the answer's events (the same
    for a stream and for one JSON reply)."""

    def __init__(self, model: str, req: Request, count: Callable[[str], int]):
        self.id, self.created = _id("resp_"), int(time.time())
        self.model, self.req, self.count = model, req, count
        self.output: list[dict] = []

    def response(self, status: str, fin: Finish | None = None, error: dict | None = None):
        usage = None
        if fin is not None:
            s = fin.stats
            reasoning = "".join(
                c["text"] for it in self.output if it["type"] == "reasoning" for c in it["content"]
            )
            usage = {
                "input_tokens": s.prompt_tokens,
                "input_tokens_details": {"cached_tokens": s.cached_tokens},
                "output_tokens": s.generated_tokens,
                "output_tokens_details": {
                    "reasoning_tokens": self.count(reasoning) if reasoning else 0
                },
                "total_tokens": s.prompt_tokens + s.generated_tokens,
            }
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"}
            if status == "incomplete"
            else None,
            "max_tool_calls": None,
            "model": self.model,
            "output": list(self.output),
            "service_tier": "default",
            "top_logprobs": 0,
            "usage": usage,
            "user": None,
            **self.req.echo,
        }

    @staticmethod
    def status(fin: Finish) -> str:
        return "incomplete" if fin.reason == "length" and not fin.tool_calls else "completed"

    def history(self) -> list[dict]:
        """The conversation this response ends, as chat messages (what a later
        previous_response_id continues)."""
        msg: dict = {"role": "assistant", "content": ""}
        for it in self.output:
            if it["type"] == "reasoning":
                msg["reasoning_content"] = "".join(c["text"] for c in it["content"])
            elif it["type"] == "message":
                msg["content"] += "".join(c["text"] for c in it["content"])
            else:
                msg.setdefault("tool_calls", []).append(
                    {
                        "id": it["call_id"],
                        "type": "function",
                        "function": {"name": it["name"], "arguments": json.loads(it["arguments"])},
                    }
                )
        return self.req.history + self.req.new + [msg]

    def reasoning_item(self, text: str = "", status: str = "in_progress") -> dict:
        return {
            "type": "reasoning",
            "id": _id("rs_"),
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
            "status": status,
        }

    def message_item(self, text: str = "", status: str = "in_progress") -> dict:
        return {
            "type": "message",
            "id": _id("msg_"),
            "role": "assistant",
            "status": status,
            "content": [_text_part(text)],
        }

    def call_item(self, ev: ToolCall, status: str = "completed") -> dict:
        return {
            "type": "function_call",
            "id": _id("fc_"),
            "call_id": _id("call_"),
            "name": ev.name,
            "arguments": ev.arguments,
            "status": status,
        }

    def whole(self, evs: list, fin: Finish) -> dict:
        """The non-streamed response: consecutive text of one kind is one item; message
        text that is only whitespace is none."""
        for ev in evs:
            last = self.output[-1] if self.output else None
            if isinstance(ev, ToolCall):
                self.output.append(self.call_item(ev))
            elif isinstance(ev, (Reasoning, Content)):
                kind = "reasoning" if isinstance(ev, Reasoning) else "message"
                if last is not None and last["type"] == kind:
                    last["content"][0]["text"] += ev.text
                else:
                    self.output.append(
                        (self.reasoning_item if kind == "reasoning" else self.message_item)(ev.text)
                    )
        status = self.status(fin)
        self.output = [
            it for it in self.output if it["type"] != "message" or it["content"][0]["text"].strip()
        ]
        for it in self.output:
            it["status"] = "completed" if it["type"] != "message" else status
        return self.response(status, fin)


def _text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


async def stream(
    b: Builder,
    answer: Answer,
    done: Callable[[Finish | None, APIError | None], None],
    keep: Callable[[dict], None],
) -> AsyncIterator[str]:
    """The response as server-sent events, each with its sequence_number:
    response.created, response.in_progress; per output item output_item.added, then for a
    reasoning or message item content_part.added, its reasoning_text / output_text deltas
    and .done, content_part.done, or for a function_call function_call_arguments.delta and
    .done; output_item.done; last response.completed (response.incomplete when
    max_output_tokens cut it). An error midway is an `error` event then response.failed.
    `keep(response)` stores the finished response; `done(finish, error)` is told how it
    ended (finish None and error None: cancelled)."""
    seq = 0

    def event(kind: str, **obj) -> str:
        nonlocal seq
        data = json.dumps(
            {"type": kind, **obj, "sequence_number": seq}, ensure_ascii=False, separators=(",", ":")
        )
        seq += 1
        return f"event: {kind}\ndata: {data}\n\n"

    yield event("response.created", response=b.response("in_progress"))
    yield event("response.in_progress", response=b.response("in_progress"))
    cur: dict | None = None  # the reasoning or message item open now
    held = ""  # whitespace that may yet begin a message (alone, it is none)
    fin = None

    def open_item(item: dict) -> list[str]:
        nonlocal cur
        out = close("completed")
        b.output.append(item)
        cur = item
        i = len(b.output) - 1
        out.append(event("response.output_item.added", output_index=i, item=_empty(item)))
        if item["type"] != "function_call":
            part = dict(item["content"][0], text="")
            out.append(
                event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=i,
                    content_index=0,
                    part=part,
                )
            )
        return out

    def append_text(kind: str, text: str, **extra) -> str:
        """text added to the open item's content part, and its delta event"""
        cur["content"][0]["text"] += text
        ids = dict(item_id=cur["id"], output_index=len(b.output) - 1, content_index=0)
        return event(kind, **ids, delta=text, **extra)

    def close(status: str) -> list[str]:
        nonlocal cur
        if cur is None:
            return []
        item, cur = cur, None
        i = len(b.output) - 1
        item["status"] = status if item["type"] == "message" else "completed"
        part = item["content"][0]
        done_kind = (
            "response.reasoning_text.done"
            if item["type"] == "reasoning"
            else "response.output_text.done"
        )
        extra = {"logprobs": []} if item["type"] == "message" else {}
        ids = dict(item_id=item["id"], output_index=i, content_index=0)
        return [
            event(done_kind, **ids, text=part["text"], **extra),
            event("response.content_part.done", **ids, part=part),
            event("response.output_item.done", output_index=i, item=item),
        ]

    try:
        async for ev in answer.events():
            out: list[str] = []
            if isinstance(ev, Reasoning):
                if cur is None or cur["type"] != "reasoning":
                    out += open_item(b.reasoning_item())
                out.append(append_text("response.reasoning_text.delta", ev.text))
            elif isinstance(ev, Content):
                text = ev.text
                if cur is None or cur["type"] != "message":
                    if not (held + text).strip():
                        held += text
                        continue
                    text, held = held + text, ""
                    out += open_item(b.message_item())
                out.append(append_text("response.output_text.delta", text, logprobs=[]))
            elif isinstance(ev, ToolCall):
                held = ""
                out += close("completed")
                item = b.call_item(ev)
                b.output.append(item)
                i = len(b.output) - 1
                ids = dict(item_id=item["id"], output_index=i)
                out += [
                    event("response.output_item.added", output_index=i, item=_empty(item)),
                    event("response.function_call_arguments.delta", **ids, delta=ev.arguments),
                    event(
                        "response.function_call_arguments.done",
                        **ids,
                        name=ev.name,
                        arguments=ev.arguments,
                    ),
                    event("response.output_item.done", output_index=i, item=item),
                ]
            elif isinstance(ev, Finish):
                fin = ev
            for s in out:
                yield s
    except APIError as e:  # an engine error, the time limit, shutdown
        done(None, e)
        err = e.body()["error"]
        yield event("error", code=err["code"], message=err["message"], param=err["param"])
        failed = {"code": err["code"] or err["type"], "message": err["message"]}
        yield event("response.failed", response=b.response("failed", error=failed))
        return
    if fin is None:  # cancelled: the client is gone
        done(None, None)
        return
    status = b.status(fin)
    for s in close(status):
        yield s
    final = b.response(status, fin)
    keep(final)
    done(fin, None)
    kind = "response.completed" if status == "completed" else "response.incomplete"
    yield event(kind, response=final)


def _empty(item: dict) -> dict:
    """An output item as output_item.added announces it: no text or arguments yet."""
    if item["type"] == "function_call":
        return dict(item, arguments="", status="in_progress")
    return dict(item, content=[], status="in_progress")
