"""Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens) over the chat
pipeline: the request becomes a ChatRequest (system, messages with text / image /
tool_use / tool_result / thinking blocks, tools, tool_choice, thinking, stop_sequences,
sampling), and the answer's events (server/events.py) become a message object or its
server-sent events. Errors have Anthropic's shape {"type": "error", "error": {"type",
"message"}}."""

from __future__ import annotations

import json
import secrets
from typing import AsyncIterator, Callable

from kestrel_cli.server.events import Answer, Content, Finish, Reasoning, ToolCall
from kestrel_cli.server.models import (
    APIError,
    ChatRequest,
    Options,
    _short,
    is_int,
    parse_messages,
    parse_tools,
    scrub_paths,
    unsupported,
)

PATH = "/v1/messages"  # this route and the routes under it answer errors in this API's shape

# an HTTP status -> Anthropic's error type
_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    408: "timeout_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
}


def is_anthropic(path: str) -> bool:
    return path == PATH or path.startswith(PATH + "/")


def error_body(err: APIError) -> dict:
    kind = _ERROR_TYPES.get(
        err.status, "invalid_request_error" if err.status < 500 else "api_error"
    )
    return {"type": "error", "error": {"type": kind, "message": scrub_paths(err.message)}}


# ---------------------------------------------------------------------------- requests


def _blocks(content, param: str) -> list[dict]:
    """A message's content as a list of blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise APIError(f"'{param}' must be a string or an array of content blocks", param=param)
    for j, b in enumerate(content):
        if not isinstance(b, dict) or not isinstance(b.get("type"), str):
            raise APIError(f"'{param}[{j}]' must be a content block (an object with a type)")
    return content


def _text(b: dict, param: str) -> str:
    if not isinstance(b.get("text"), str):
        raise APIError(f"'{param}.text' must be a string", param=f"{param}.text")
    return b["text"]


def _image(b: dict, param: str) -> dict:
    """An image block -> the chat pipeline's image_url part (a base64 data: URL)."""
    src = b.get("source")
    if not isinstance(src, dict) or src.get("type") != "base64":
        raise unsupported(
            f"{param}.source", ": images are sent inline ({'type': 'base64', 'media_type', 'data'})"
        )
    media, data = src.get("media_type"), src.get("data")
    if not isinstance(media, str) or not isinstance(data, str):
        raise APIError(
            f"'{param}.source' needs media_type and data (strings)", param=f"{param}.source"
        )
    return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}


def _tool_result_text(b: dict, param: str) -> str:
    content = b.get("content", "")
    if isinstance(content, str):
        return content
    texts = []
    for j, c in enumerate(_blocks(content, f"{param}.content")):
        if c["type"] != "text":
            raise unsupported(
                f"{param}.content[{j}].type", ": a tool_result holds text blocks only"
            )
        texts.append(_text(c, f"{param}.content[{j}]"))
    return "\n".join(texts)


def _system(system) -> str:
    if isinstance(system, str):
        return system
    blocks = _blocks(system, "system")
    for j, b in enumerate(blocks):
        if b["type"] != "text":
            raise APIError(f"'system[{j}]' must be a text block", param=f"system[{j}]")
    return "\n".join(_text(b, f"system[{j}]") for j, b in enumerate(blocks))


def _messages(body: dict) -> list[dict]:
    """system + messages -> OpenAI-shaped chat messages (checked again by parse_messages):
    user text and images; each tool_result a tool message, in place; assistant text, its
    thinking as reasoning_content, its tool_use blocks as tool_calls."""
    out = []
    system = _system(body["system"]) if body.get("system") is not None else ""
    if system:  # an empty one renders no system turn
        out.append({"role": "system", "content": system})
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise APIError("'messages' must be a non-empty array", param="messages")
    for i, m in enumerate(msgs):
        p = f"messages[{i}]"
        if not isinstance(m, dict):
            raise APIError(f"'{p}' must be an object", param=p)
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise APIError(
                f"'{p}.role' must be user or assistant; got {_short(role)}", param=f"{p}.role"
            )
        if "content" not in m:
            raise APIError(f"'{p}.content' is required", param=f"{p}.content")
        blocks = _blocks(m["content"], f"{p}.content")
        if not blocks:
            raise APIError(f"'{p}.content' must not be empty", param=f"{p}.content")
        if role == "user":
            parts: list[dict] = []

            def flush():
                if parts:
                    out.append({"role": "user", "content": list(parts)})
                    parts.clear()

            for j, b in enumerate(blocks):
                q = f"{p}.content[{j}]"
                if b["type"] == "text":
                    parts.append({"type": "text", "text": _text(b, q)})
                elif b["type"] == "image":
                    parts.append(_image(b, q))
                elif b["type"] == "tool_result":
                    if not isinstance(b.get("tool_use_id"), str):
                        raise APIError(
                            f"'{q}.tool_use_id' is required (a string)", param=f"{q}.tool_use_id"
                        )
                    flush()
                    out.append(
                        {
                            "role": "tool",
                            "tool_call_id": b["tool_use_id"],
                            "content": _tool_result_text(b, q),
                        }
                    )
                else:
                    raise unsupported(
                        f"{q}.type",
                        f": user blocks are text, image and tool_result (got {_short(b['type'])})",
                    )
            flush()
            continue
        texts, thinking, calls = [], [], []
        for j, b in enumerate(blocks):
            q = f"{p}.content[{j}]"
            if b["type"] == "text":
                texts.append(_text(b, q))
            elif b["type"] == "thinking":
                if not isinstance(b.get("thinking"), str):
                    raise APIError(f"'{q}.thinking' must be a string", param=f"{q}.thinking")
                thinking.append(b["thinking"])
            elif b["type"] == "redacted_thinking":
                continue  # another model's encrypted reasoning: nothing this one can read
            elif b["type"] == "tool_use":
                if not isinstance(b.get("name"), str) or not isinstance(b.get("id"), str):
                    raise APIError(f"'{q}' needs an id and a name (strings)", param=q)
                if not isinstance(b.get("input", {}), dict):
                    raise APIError(f"'{q}.input' must be an object", param=f"{q}.input")
                calls.append(
                    {
                        "id": b["id"],
                        "type": "function",
                        "function": {"name": b["name"], "arguments": b.get("input", {})},
                    }
                )
            else:
                raise unsupported(
                    f"{q}.type",
                    f": assistant blocks are text, thinking and tool_use (got {_short(b['type'])})",
                )
        msg = {"role": "assistant", "content": "".join(texts)}
        if thinking:
            msg["reasoning_content"] = "\n".join(thinking)
        if calls:
            msg["tool_calls"] = calls
        out.append(msg)
    if out[-1]["role"] == "assistant":
        raise unsupported(
            f"messages[{len(msgs) - 1}]",
            ": the last message must be the user's (an assistant prefill is not continued)",
        )
    return parse_messages({"messages": out})


def _tools(body: dict, thinking: bool) -> tuple[list[dict] | None, str | None]:
    """tools and tool_choice -> the chat pipeline's (tools, forced function)."""
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
            if t.get("type", "custom") != "custom":
                raise unsupported(
                    f"{p}.type",
                    f": only client tools ({{name, description, input_schema}}), not "
                    f"{_short(t.get('type'))}",
                )
            if not isinstance(t.get("name"), str) or not t["name"]:
                raise APIError(f"'{p}.name' is required (a string)", param=f"{p}.name")
            schema = t.get("input_schema")
            if not isinstance(schema, dict):
                raise APIError(
                    f"'{p}.input_schema' is required (a JSON schema, an object)",
                    param=f"{p}.input_schema",
                )
            fn = {"name": t["name"]}  # OpenAI's order: the template writes the tool as JSON
            if isinstance(t.get("description"), str):
                fn["description"] = t["description"]
            fn["parameters"] = schema
            chat_tools.append({"type": "function", "function": fn})
    chat_choice = None
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind == "tool":
            name = choice.get("name")
            if not isinstance(name, str):
                raise APIError("'tool_choice.name' must be a string", param="tool_choice.name")
            if name not in [t["function"]["name"] for t in chat_tools or []]:
                raise APIError(
                    f"'tool_choice.name': {_short(name)} is not one of the tools",
                    param="tool_choice.name",
                )
            chat_choice = {"type": "function", "function": {"name": name}}
        elif kind in ("auto", "any", "none"):
            chat_choice = {"auto": "auto", "any": "required", "none": "none"}[kind]
        else:
            raise APIError(
                '\'tool_choice\' must be {"type": "auto" | "any" | "none"} or '
                '{"type": "tool", "name": ...}',
                param="tool_choice",
            )
        if kind in ("any", "tool") and thinking:
            raise APIError(
                "thinking may not be enabled when tool_choice forces tool use",
                param="tool_choice",
            )
    return parse_tools({"tools": chat_tools, "tool_choice": chat_choice})


def parse_request(body: dict, count_only: bool = False) -> ChatRequest:
    """A Messages request (or count_tokens' subset) -> the chat pipeline's request."""
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise APIError("'model' must be a string", param="model")
    max_tokens = body.get("max_tokens")
    if not count_only:
        if max_tokens is None:
            raise APIError("'max_tokens' is required", param="max_tokens")
        if not is_int(max_tokens) or max_tokens < 1:
            raise APIError("'max_tokens' must be an integer >= 1", param="max_tokens")
    if body.get("mcp_servers"):
        raise unsupported("mcp_servers")
    if body.get("output_format") is not None:
        raise unsupported("output_format")
    stops = body.get("stop_sequences")
    if stops is not None and (
        not isinstance(stops, list) or not all(isinstance(s, str) for s in stops)
    ):
        raise APIError("'stop_sequences' must be an array of strings", param="stop_sequences")
    temperature = body.get("temperature")
    if isinstance(temperature, (int, float)) and not 0 <= temperature <= 1:
        raise APIError("'temperature' must be in [0, 1]", param="temperature")
    if body.get("metadata") is not None and not isinstance(body["metadata"], dict):
        raise APIError("'metadata' must be an object", param="metadata")
    kwargs: dict = {}
    fields = {k: body.get(k) for k in ("temperature", "top_p", "top_k", "stream")}
    fields.update(max_tokens=max_tokens if not count_only else None, stop=stops)
    thinking = body.get("thinking")
    thinking_on = False
    if thinking is not None:
        kind = thinking.get("type") if isinstance(thinking, dict) else None
        if kind == "enabled":
            budget = thinking.get("budget_tokens")
            if not is_int(budget) or budget < 1:
                raise APIError(
                    "'thinking.budget_tokens' must be an integer >= 1",
                    param="thinking.budget_tokens",
                )
            if is_int(max_tokens) and budget >= max_tokens:
                raise APIError(
                    "'thinking.budget_tokens' must be less than 'max_tokens'",
                    param="thinking.budget_tokens",
                )
            # the generation's thinking budget (Options.reasoning_budget, the budget branch's
            # field; a tree without it ignores the field, and thinking is unbounded)
            fields["reasoning_budget"] = budget
        elif kind not in ("disabled", "adaptive"):
            raise APIError(
                '\'thinking\' must be {"type": "enabled", "budget_tokens": N}, '
                '{"type": "adaptive"} or {"type": "disabled"}',
                param="thinking",
            )
        thinking_on = kind != "disabled"
        kwargs["enable_thinking"] = thinking_on
    messages = _messages(body)
    tools, forced = _tools(body, thinking_on)
    opts = Options.parse(fields)
    return ChatRequest(messages, tools, forced, opts, kwargs, None)


# ---------------------------------------------------------------------------- replies


def _stop_reason(fin: Finish) -> str:
    if fin.tool_calls:
        return "tool_use"
    if fin.stop_sequence is not None:
        return "stop_sequence"
    return "max_tokens" if fin.reason == "length" else "end_turn"


def _usage(fin: Finish) -> dict:
    """Anthropic's usage: input_tokens are those prefilled, the cached prefix counted apart
    (their sum is the prompt)."""
    s = fin.stats
    return {
        "input_tokens": s.prompt_tokens - s.cached_tokens,
        "output_tokens": s.generated_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": s.cached_tokens,
    }


def _tool_use(ev: ToolCall) -> dict:
    return {
        "type": "tool_use",
        "id": "toolu_" + secrets.token_hex(12),
        "name": ev.name,
        "input": json.loads(ev.arguments),
    }


def message(model: str, evs: list, fin: Finish) -> dict:
    """The whole message: thinking, text and tool_use blocks in the answer's order
    (consecutive text of one kind is one block)."""
    content: list[dict] = []
    for ev in evs:
        if isinstance(ev, ToolCall):
            content.append(_tool_use(ev))
            continue
        if isinstance(ev, Reasoning):
            kind, key = "thinking", "thinking"
        elif isinstance(ev, Content):
            kind, key = "text", "text"
        else:
            continue
        if content and content[-1]["type"] == kind:
            content[-1][key] += ev.text
        else:
            block = {"type": kind, key: ev.text}
            if kind == "thinking":
                block["signature"] = ""  # nothing to verify here: thinking comes back as is
            content.append(block)
    # text that is only whitespace (around tool calls, after the thinking) is not a block
    content = [b for b in content if b["type"] != "text" or b["text"].strip()]
    return {
        "id": "msg_" + secrets.token_hex(12),
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content,
        "stop_reason": _stop_reason(fin),
        "stop_sequence": fin.stop_sequence,
        "usage": _usage(fin),
    }


def _event(kind: str, obj: dict) -> str:
    data = json.dumps({"type": kind, **obj}, ensure_ascii=False, separators=(",", ":"))
    return f"event: {kind}\ndata: {data}\n\n"


async def stream(
    model: str,
    answer: Answer,
    done: Callable[[Finish | None, APIError | None], None],
) -> AsyncIterator[str]:
    """The message as server-sent events: message_start, ping, then per block
    content_block_start, its deltas (text_delta, thinking_delta then signature_delta,
    input_json_delta) and content_block_stop, then message_delta (stop_reason and usage)
    and message_stop. An error midway is an `error` event. `done(finish, error)` is told
    how it ended (finish None and error None: cancelled)."""
    yield _event(
        "message_start",
        {
            "message": {
                "id": "msg_" + secrets.token_hex(12),
                "type": "message",
                "role": "assistant",
                "model": model,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {
                    "input_tokens": len(answer.job.ids),
                    "output_tokens": 0,
                    "cache_creation_input_tokens": 0,
                    "cache_read_input_tokens": 0,
                },
            }
        },
    )
    yield _event("ping", {})
    index, open_kind = -1, None
    fin = None
    held = ""  # whitespace that may yet begin a text block (alone, it is none)

    def close():
        nonlocal open_kind
        out = []
        if open_kind == "thinking":
            out.append(
                _event(
                    "content_block_delta",
                    {"index": index, "delta": {"type": "signature_delta", "signature": ""}},
                )
            )
        if open_kind is not None:
            out.append(_event("content_block_stop", {"index": index}))
        open_kind = None
        return out

    def open_block(block: dict):
        nonlocal index, open_kind
        out = close()
        index += 1
        open_kind = block["type"]
        out.append(_event("content_block_start", {"index": index, "content_block": block}))
        return out

    try:
        async for ev in answer.events():
            out: list[str] = []
            if isinstance(ev, Reasoning):
                if open_kind != "thinking":
                    out += open_block({"type": "thinking", "thinking": "", "signature": ""})
                delta = {"type": "thinking_delta", "thinking": ev.text}
                out.append(_event("content_block_delta", {"index": index, "delta": delta}))
            elif isinstance(ev, Content):
                text = ev.text
                if open_kind != "text":
                    if not (held + text).strip():
                        held += text
                        continue
                    text, held = held + text, ""
                    out += open_block({"type": "text", "text": ""})
                delta = {"type": "text_delta", "text": text}
                out.append(_event("content_block_delta", {"index": index, "delta": delta}))
            elif isinstance(ev, ToolCall):
                block = _tool_use(ev)
                held = ""
                out += open_block({**block, "input": {}})
                delta = {"type": "input_json_delta", "partial_json": ev.arguments}
                out.append(_event("content_block_delta", {"index": index, "delta": delta}))
                out += close()
            elif isinstance(ev, Finish):
                fin = ev
            for s in out:
                yield s
    except APIError as e:  # an engine error, the time limit, shutdown
        done(None, e)
        yield _event("error", {"error": error_body(e)["error"]})
        return
    if fin is None:  # cancelled: the client is gone
        done(None, None)
        return
    for s in close():
        yield s
    done(fin, None)
    yield _event(
        "message_delta",
        {
            "delta": {"stop_reason": _stop_reason(fin), "stop_sequence": fin.stop_sequence},
            "usage": _usage(fin),
        },
    )
    yield _event("message_stop", {})
