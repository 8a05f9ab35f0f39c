"""One answer as structured events, for every API's formatter: the OpenAI chat and
completions replies (server/app.py), Anthropic's Messages (server/anthropic.py) and
OpenAI's Responses (server/responses.py) all read the same stream.

`Answer.events()` turns an admitted Job's Chunks into, in order: `Token` (each sampled
token's chunk, for logprobs and counting), `Reasoning` / `Content` text deltas and
`ToolCall`s (a chat answer goes through an AnswerSplitter; a plain completion is all
Content), then one `Finish`. A cancelled job (the client went away) ends without a Finish;
an engine error, the time limit or shutdown raise APIError from the iteration.
"""

from __future__ import annotations

import dataclasses
from typing import AsyncIterator, Callable

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.inference.generate import Chunk, Stats
from kestrel_cli.server.scheduler import Job
from kestrel_cli.text.reasoning import AnswerSplitter


@dataclasses.dataclass
class Token:
    chunk: Chunk  # a sampled token's chunk (its text also comes as a delta)


@dataclasses.dataclass
class Reasoning:
    text: str


@dataclasses.dataclass
class Content:
    text: str


@dataclasses.dataclass
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text
    index: int  # 0, 1, ... in the answer


@dataclasses.dataclass
class Finish:
    reason: str  # the engine's: "stop" (EOS, a stop string, a complete grammar) | "length"
    stats: Stats
    tool_calls: int  # how many ToolCall events came
    stop_sequence: str | None  # the stop string that ended the answer, if one did


Event = Token | Reasoning | Content | ToolCall | Finish


@dataclasses.dataclass
class Answer:
    """An admitted chat or completion job and how to read its text: `split` holds the
    AnswerSplitter arguments (None: plain text); `prefix` is answer text the prompt already
    holds and `suffix` text the answer implies after its last token (a forced tool call's
    opening and closing tags)."""

    job: Job
    split: dict | None = None
    prefix: str = ""
    suffix: str = ""
    decode: Callable[[list[int]], str] | None = None  # the tokenizer's, for stop_sequence

    async def events(self) -> AsyncIterator[Event]:
        sp = AnswerSplitter(**self.split) if self.split is not None else None
        calls = 0

        def parts(text: str, final: bool = False):
            nonlocal calls
            if sp is None:
                if text:
                    yield Content(text)
                return
            got = sp.feed(text)
            if final:
                got += sp.finish()
            for kind, value in got:
                if kind == "reasoning":
                    yield Reasoning(value)
                elif kind == "content":
                    yield Content(value)
                else:
                    yield ToolCall(value["name"], value["arguments"], calls)
                    calls += 1

        if self.prefix:
            for ev in parts(self.prefix):
                yield ev
        last, texts, tokens = None, [], []
        async for ch in self.job.chunks():
            if ch.token is not None:
                tokens.append(ch.token)
                yield Token(ch)
            if ch.text:
                texts.append(ch.text)
                for ev in parts(ch.text):
                    yield ev
            last = ch if ch.finish_reason else last
        if last is None:  # cancelled
            return
        if sp is not None:
            for ev in parts(self.suffix, final=True):
                yield ev
        yield Finish(
            last.finish_reason,
            last.stats,
            calls,
            self._stop_sequence(last, "".join(texts), tokens),
        )

    def _stop_sequence(self, last: Chunk, text: str, tokens: list[int]) -> str | None:
        """Which stop string ended the answer, or None (EOS, the length limit, a grammar).
        A stop string ends it right after the token that completed it, so every sampled
        token has its chunk; EOS is sampled but has none. The string is the one that
        starts first in the text the tokens decode to past what was emitted."""
        stops = self.job.params.get("stop") or []
        if (
            last.finish_reason != "stop"
            or not stops
            or self.job.params.get("json_schema") is not None
            or last.stats.generated_tokens != len(tokens)
            or self.decode is None
        ):
            return None
        try:
            rest = self.decode(tokens)[len(text) :]
        except KestrelError:  # a padding row of the embeddings, past the tokenizer's vocab
            return None
        found = [(rest.find(s), i) for i, s in enumerate(stops) if s in rest]
        return stops[min(found)[1]] if found else None
