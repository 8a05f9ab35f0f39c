"""Requests of the OpenAI API: the fields we read, checked, and the error reply's shape."""

from __future__ import annotations

import json
import os
import re

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from kestrel_cli.text.constrained import MAX_JSON_DEPTH, too_deep

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions
# bounds on what one request may ask for (README: "Running it safely")
MAX_STOPS = 16  # stop strings per request
MAX_STOP_CHARS = 1024  # characters per stop string
MAX_LOGIT_BIAS = 1024  # logit_bias entries
MAX_SCHEMA_BYTES = 64 << 10  # a response_format schema or a tool's parameters, as JSON
MAX_TOOLS = 128  # tools per request
# levels of objects/arrays in a schema, a tool's parameters, a tool call's arguments and
# chat_template_kwargs: constrained.MAX_JSON_DEPTH (64), checked before anything recursive
# (json.dumps, the chat template's data copy and tojson, llguidance) reads them
TEMPLATE_RESERVED = {
    "messages",
    "add_generation_prompt",
    "tokenize",
    "tools",
    "documents",
    "chat_template",
    "max_chars",
}  # apply_chat_template's own arguments


# ---------------------------------------------------------------------------- errors


class APIError(Exception):
    """An HTTP error reply in OpenAI's shape."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
    ):
        super().__init__(message)
        self.message, self.status, self.param, self.code = message, status, param, code
        self.type = type or {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            408: "timeout_error",
            413: "invalid_request_error",
            503: "unavailable_error",
            504: "timeout_error",
        }.get(status, "invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict:
        return {
            "error": {
                "message": scrub_paths(self.message),
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status)


_ABS_PATH = re.compile(r"(?<![\w/.:])/((?:[\w.+@~-]+/)+)([\w.+@~-]*)")


def scrub_paths(message: str) -> str:
    """`message` with each absolute path on this machine (its first folder exists) cut to
    its last component: errors name the model's file, never where it or the code lives."""

    def cut(m):
        first = m.group(1).split("/", 1)[0]
        return (
            m.group(2) or m.group(1).rstrip("/").rsplit("/", 1)[-1]
            if os.path.isdir("/" + first)
            else m.group(0)
        )

    return _ABS_PATH.sub(cut, message)


def unsupported(name: str, why: str = "") -> APIError:
    return APIError(
        f"'{name}' is not supported by this server{why}", param=name, code="unsupported_parameter"
    )


# ---------------------------------------------------------------------------- request parsing


class _Fields(BaseModel):
    """JSON types are strict ("1" is not a number), null means the default, and fields we do
    not read are ignored (check_unsupported has refused those that would change the reply)."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, body):
        return {k: v for k, v in body.items() if v is not None} if isinstance(body, dict) else body


class StreamOptions(_Fields):
    include_usage: bool = False


class Options(_Fields):
    """The generation fields of both endpoints: OpenAI's (defaults temperature 1.0, top_p 1.0;
    temperature 0 is greedy) and llama-server's top_k, min_p, repeat_penalty, ignore_eos and
    cache_prompt."""

    model: str | None = None
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, ge=0, le=1)
    top_k: int = Field(0, ge=0)
    min_p: float = Field(0.0, ge=0, le=1)
    repeat_penalty: float = Field(1.0, gt=0)
    seed: int | None = None
    stop: str | list[str] | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # the newer name; wins
    ignore_eos: bool = False
    cache_prompt: bool = True  # False: prefill the whole prompt
    stream: bool = False
    stream_options: StreamOptions | None = None
    chat_template_kwargs: dict | None = None
    reasoning_effort: str | None = None  # "none": thinking off; others: on (Qwen3)
    # tokens of thinking before the <think> block is closed (-1 unlimited, 0 none; null:
    # the server's --reasoning-budget)
    reasoning_budget: int | None = Field(None, ge=-1)
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    logprobs: bool | int | None = None  # chat: a bool; /v1/completions: 0..5 alternatives
    top_logprobs: int = Field(0, ge=0, le=20)
    response_format: dict | None = None

    @classmethod
    def parse(cls, body: dict) -> "Options":
        """The fields of `body`, or APIError naming the first bad one."""
        try:
            return cls.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            # union members appear in the location as their type names; keep the JSON path
            path = [str(x) for x in err["loc"] if isinstance(x, str) and x in _PATH_NAMES]
            param = ".".join(path) or None
            raise APIError(f"'{param}': {err['msg']}", param=param) from None

    def sampling(self, default_max_tokens: int) -> dict:
        """Engine.stream keyword arguments."""
        temperature, top_p = self.temperature, self.top_p
        if top_p == 0:  # the smallest set with mass >= 0: the top token
            temperature, top_p = 0.0, 1.0
        seed = None if self.seed is None else self.seed & ((1 << 64) - 1)  # numpy: unsigned
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOPS:
            raise APIError(f"'stop': at most {MAX_STOPS} strings, got {len(stops)}", param="stop")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise APIError(f"'stop': each string at most {MAX_STOP_CHARS} characters", param="stop")
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        bias = {}
        for k, v in (self.logit_bias or {}).items():
            if not k.strip().isdigit():
                raise APIError(
                    f"'logit_bias': keys must be token ids, got {_short(k)}", param="logit_bias"
                )
            if not -100 <= v <= 100:
                raise APIError("'logit_bias': values must be in [-100, 100]", param="logit_bias")
            bias[int(k)] = float(v)
        return dict(
            max_tokens=max_tokens,
            temperature=float(temperature),
            top_k=self.top_k,
            top_p=float(top_p),
            min_p=float(self.min_p),
            repeat_penalty=float(self.repeat_penalty),
            seed=seed,
            stop=[s for s in stops if s],
            ignore_eos=self.ignore_eos,
            presence_penalty=float(self.presence_penalty),
            frequency_penalty=float(self.frequency_penalty),
            logit_bias=bias or None,
            logprobs=self.n_logprobs,
            json_schema=self.json_schema,
            reasoning_budget=self.reasoning_budget,
        )

    @property
    def json_schema(self) -> dict | None:
        """response_format as the schema the answer must match (None: free text)."""
        rf = self.response_format
        if rf is None or rf.get("type") == "text":
            return None
        if rf.get("type") == "json_object":
            return {"type": "object"}
        if rf.get("type") == "json_schema":
            js = rf.get("json_schema")
            if not isinstance(js, dict) or not isinstance(js.get("schema", {}), dict):
                raise APIError(
                    "'response_format.json_schema.schema' must be an object",
                    param="response_format.json_schema",
                )
            schema = js.get("schema") or {"type": "object"}
            check_depth(schema, "response_format")
            check_schema_size(schema, "response_format.json_schema.schema")
            return schema
        raise APIError(
            "'response_format.type' must be text, json_object or json_schema",
            param="response_format.type",
        )

    @property
    def n_logprobs(self) -> int | None:
        """How many alternatives per token (None: no logprobs): chat's top_logprobs when
        logprobs is true; /v1/completions' logprobs (an integer, at most 5)."""
        if self.logprobs is None or self.logprobs is False:
            if self.top_logprobs:
                raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            return None
        if self.logprobs is True:
            return self.top_logprobs
        if not 0 <= self.logprobs <= 5:
            raise APIError("'logprobs' must be in 0..5", param="logprobs")
        return self.logprobs

    @property
    def include_usage(self) -> bool:
        return self.stream and bool(self.stream_options and self.stream_options.include_usage)

    def template_kwargs(self) -> dict:
        """chat_template_kwargs (e.g. enable_thinking), none of apply_chat_template's own."""
        kwargs = self.chat_template_kwargs or {}
        check_depth(kwargs, "chat_template_kwargs")  # they reach the template as they are
        bad = sorted(TEMPLATE_RESERVED & set(kwargs))
        if bad:
            raise APIError(
                f"'chat_template_kwargs.{bad[0]}' is not allowed",
                param=f"chat_template_kwargs.{bad[0]}",
            )
        if self.reasoning_effort is not None:
            if self.reasoning_effort not in REASONING_EFFORTS:
                raise APIError(
                    f"'reasoning_effort' must be one of {', '.join(REASONING_EFFORTS)}",
                    param="reasoning_effort",
                )
            if "enable_thinking" not in kwargs:  # chat_template_kwargs wins
                kwargs = {**kwargs, "enable_thinking": self.reasoning_effort != "none"}
        return kwargs


REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high")

_PATH_NAMES = set(Options.model_fields) | set(StreamOptions.model_fields)


# fields that would change what the reply means; accepted only at their neutral value
_NEUTRAL = {
    "n": lambda v: v == 1,
    "functions": lambda v: v == [],
    "function_call": lambda v: v == "none",
    "modalities": lambda v: v == ["text"],
    "audio": lambda v: False,
    "prediction": lambda v: False,
    "web_search_options": lambda v: False,
    "echo": lambda v: v is False,  # /v1/completions
    "suffix": lambda v: v == "",  # /v1/completions
    "best_of": lambda v: v == 1,  # /v1/completions
}


def check_depth(value, param: str, limit: int = MAX_JSON_DEPTH) -> None:
    """A JSON value nested more than `limit` levels is refused (checked without recursion)."""
    if too_deep(value, limit):
        raise APIError(f"'{param}' is nested more than {limit} levels deep", param=param)


def _short(v, n: int = 80) -> str:
    """A client's value quoted in an error message: repr(v) cut to about n characters for a
    string or a number, the type's name for anything else (its repr could be megabytes, or
    recurse past Python's limit)."""
    if v is not None and not isinstance(v, (str, int, float)):
        return type(v).__name__
    r = repr(v)
    return r if len(r) <= n else r[:n] + "…"


def check_schema_size(schema, param: str) -> None:
    """A JSON schema larger than MAX_SCHEMA_BYTES is refused before it is compiled (compile
    time grows with its size)."""
    n = len(json.dumps(schema, ensure_ascii=False))
    if n > MAX_SCHEMA_BYTES:
        raise APIError(
            f"'{param}' is {n} bytes of JSON, more than the {MAX_SCHEMA_BYTES >> 10} KiB allowed",
            param=param,
        )


def first_bad_string(v, path: str = "") -> str | None:
    """The JSON path of the first string (or object key) in `v` holding a lone UTF-16
    surrogate (JSON's "\\ud800" escape decodes to one; it is not valid Unicode), or None."""

    def bad(s: str) -> bool:
        try:
            s.encode("utf-8")
            return False
        except UnicodeEncodeError:
            return True

    stack = [(v, path)]
    while stack:
        v, p = stack.pop()
        if isinstance(v, str) and bad(v):
            return p or "body"
        if isinstance(v, dict):
            for k, x in v.items():
                q = f"{p}.{k}" if p else str(k)
                if bad(k):
                    return p or "body"
                stack.append((x, q))
        elif isinstance(v, list):
            stack.extend((x, f"{p}[{i}]") for i, x in enumerate(v))
    return None


def check_unsupported(body: dict) -> None:
    for name, neutral in _NEUTRAL.items():
        v = body.get(name)
        if v is not None and not neutral(v):
            why = ": one choice per request" if name == "n" else ""
            raise unsupported(name, why)


def text_content(content, param: str):
    """A message's content: a string, or an array of content parts. Text parts only: their
    texts joined with newlines; with image or video parts (OpenAI `image_url`, `video_url`:
    a base64 data: URL; remote URLs are refused, nothing is fetched): Hugging Face content
    parts, images as {"type": "image", "image": data URL}, videos as {"type": "video",
    "video": data URL}, for the engine to decode."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(f"'{param}' must be a string or an array of content parts", param=param)
    parts, has_image = [], False
    for j, part in enumerate(content):
        p = f"{param}[{j}]"
        if not isinstance(part, dict):
            raise APIError(f"'{p}' must be an object", param=p)
        kind = part.get("type")
        if kind in ("image_url", "video_url"):
            media = kind[: -len("_url")]
            url = part.get(kind)
            url = url.get("url") if isinstance(url, dict) else url
            if not isinstance(url, str):
                raise APIError(f"'{p}.{kind}.url' must be a string", param=f"{p}.{kind}.url")
            if not url.startswith("data:"):
                raise APIError(
                    f"'{p}.{kind}.url': remote {media} URLs are not fetched; send "
                    f"the {media} inline as a base64 data: URL",
                    param=f"{p}.{kind}.url",
                )
            parts.append({"type": media, media: url})
            has_image = True
            continue
        if kind != "text":
            if isinstance(kind, str):
                raise unsupported(
                    f"{p}.type",
                    f": only text, image_url and video_url parts (got {_short(kind)})",
                )
            raise APIError(f"'{p}.type' must be a string", param=f"{p}.type")
        if not isinstance(part.get("text"), str):
            raise APIError(f"'{p}.text' must be a string", param=f"{p}.text")
        parts.append({"type": "text", "text": part["text"]})
    if has_image:
        return parts
    return "\n".join(q["text"] for q in parts)


def content_chars(content) -> int:
    """Characters of text in a parsed message content (images and videos not counted)."""
    if isinstance(content, str):
        return len(content)
    return sum(len(q["text"]) for q in content if q["type"] == "text")


def parse_messages(body: dict) -> list[dict]:
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
        if role == "function" or m.get("function_call"):
            raise unsupported(
                f"{p}.role" if role == "function" else f"{p}.function_call",
                ": the legacy functions API; use tools",
            )
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise APIError(
                f"'{p}.role' must be one of system, developer, user, assistant, "
                f"tool; got {_short(role)}",
                param=f"{p}.role",
            )
        content = m.get("content")
        if content is None:
            if role != "assistant":
                raise APIError(f"'{p}.content' is required", param=f"{p}.content")
            content = ""
        msg = {
            "role": "system" if role == "developer" else role,
            "content": text_content(content, f"{p}.content"),
        }
        if role == "tool":
            if not isinstance(m.get("tool_call_id"), str):
                raise APIError(
                    f"'{p}.tool_call_id' is required (a string)", param=f"{p}.tool_call_id"
                )
            if not isinstance(msg["content"], str):
                raise APIError(f"'{p}.content' must be text", param=f"{p}.content")
            msg["tool_call_id"] = m["tool_call_id"]
        if role == "assistant" and m.get("tool_calls") is not None:
            msg["tool_calls"] = parse_tool_calls(m["tool_calls"], f"{p}.tool_calls")
        if role == "assistant" and isinstance(m.get("reasoning_content"), str):
            msg["reasoning_content"] = m["reasoning_content"]
        out.append(msg)
    return out


def parse_tool_calls(calls, param: str) -> list[dict]:
    """An assistant message's tool_calls, as the chat templates read them (arguments an
    object when they are a JSON object string, as transformers documents)."""
    if not isinstance(calls, list):
        raise APIError(f"'{param}' must be an array", param=param)
    out = []
    for j, c in enumerate(calls):
        q = f"{param}[{j}]"
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise APIError(
                f"'{q}.function.name' is required (a string)", param=f"{q}.function.name"
            )
        args = fn.get("arguments", "{}")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise APIError(
                    f"'{q}.function.arguments' is not valid JSON", param=f"{q}.function.arguments"
                ) from None
            except RecursionError:  # json.loads recurses once per level
                raise APIError(
                    f"'{q}.function.arguments' is nested more than {MAX_JSON_DEPTH} levels deep",
                    param=f"{q}.function.arguments",
                ) from None
        # the template copies them and writes them with tojson: both recurse once per level
        check_depth(args, f"{q}.function.arguments")
        if not isinstance(args, dict):
            raise APIError(
                f"'{q}.function.arguments' must be a JSON object", param=f"{q}.function.arguments"
            )
        out.append(
            {
                "id": c.get("id") if isinstance(c.get("id"), str) else f"call_{j}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


def parse_tools(body: dict) -> tuple[list[dict] | None, str | None]:
    """(the tools to render, or None; the function name a tool_choice forces, or "" for
    'required', None otherwise)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            raise APIError("'tool_choice' needs 'tools'", param="tool_choice")
        return None, None
    if not isinstance(tools, list):
        raise APIError("'tools' must be an array", param="tools")
    if len(tools) > MAX_TOOLS:
        raise APIError(f"'tools': at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    names = []
    for j, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if (
            not isinstance(t, dict)
            or t.get("type") != "function"
            or not isinstance(fn, dict)
            or not isinstance(fn.get("name"), str)
            or not fn["name"]
        ):
            raise APIError(
                f'\'tools[{j}]\' must be {{"type": "function", "function": '
                f'{{"name": ..., "parameters": ...}}}}',
                param=f"tools[{j}]",
            )
        if fn.get("parameters") is not None:
            if not isinstance(fn["parameters"], dict):
                raise APIError(
                    f"'tools[{j}].function.parameters' must be a JSON schema (an object)",
                    param=f"tools[{j}].function.parameters",
                )
            # tool_choice 'required' enforces {"anyOf": [{... "properties": {"arguments":
            # parameters}}]} (server.app.forced_schema): 4 levels around them, and that schema
            # is held to MAX_JSON_DEPTH as a whole
            check_depth(
                fn["parameters"],
                f"tools[{j}].function.parameters",
                MAX_JSON_DEPTH - 4 if choice == "required" else MAX_JSON_DEPTH,
            )
            check_schema_size(fn["parameters"], f"tools[{j}].function.parameters")
        # the whole tool reaches the template: parameters sit 2 levels inside it
        check_depth(t, f"tools[{j}]", MAX_JSON_DEPTH + 2)
        names.append(fn["name"])
    if choice is None or choice == "auto":
        return tools, None
    if choice == "none":
        return None, None
    if choice == "required":
        return tools, ""
    if (
        isinstance(choice, dict)
        and isinstance(choice.get("function"), dict)
        and choice.get("type") == "function"
    ):
        name = choice["function"].get("name")
        if not isinstance(name, str):
            raise APIError(
                "'tool_choice.function.name' must be a string", param="tool_choice.function.name"
            )
        if name not in names:
            raise APIError(
                f"'tool_choice.function.name': {_short(name)} is not one of the tools",
                param="tool_choice.function.name",
            )
        return tools, name
    raise APIError(
        "'tool_choice' must be none, auto, required or "
        '{"type": "function", "function": {"name": ...}}',
        param="tool_choice",
    )


def is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def parse_prompt(body: dict) -> str | list[int]:
    """/v1/completions' prompt: a string or token ids (a batch of one is unwrapped)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        return prompt  # token ids, used as is
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        raise unsupported("prompt", ": one prompt per request, not a batch")
    if not isinstance(prompt, str):
        raise APIError(
            "'prompt' must be a string or an array of token ids"
            if prompt is not None
            else "'prompt' is required",
            param="prompt",
        )
    return prompt


class ChatRequest:
    """A chat request as the pipeline reads it, whichever API it came in: messages in the
    chat template's form, the tools to render (or None), the function a tool_choice forces
    ("" any, None none), the generation Options, the template's keyword arguments and the
    JSON schema the answer must match (None: free text)."""

    def __init__(
        self,
        messages: list[dict],
        tools: list[dict] | None,
        forced: str | None,
        opts: "Options",
        kwargs: dict,
        schema: dict | None,
        schema_param: str = "response_format",
    ):
        self.messages, self.tools, self.forced = messages, tools, forced
        self.opts, self.kwargs, self.schema = opts, kwargs, schema
        self.schema_param = schema_param  # the field an error in the schema names

    @classmethod
    def parse(cls, body: dict) -> "ChatRequest":
        """/v1/chat/completions' body (OpenAI's fields), checked in this order."""
        check_unsupported(body)
        messages = parse_messages(body)
        tools, forced = parse_tools(body)
        opts = Options.parse(body)
        return cls(messages, tools, forced, opts, opts.template_kwargs(), opts.json_schema)
