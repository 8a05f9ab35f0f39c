"""`kestrel chat`: a multi-turn conversation in the terminal.

The engine keeps the KV cache between calls and reuses the longest cached prefix, so each
turn prefills only its new tokens: the end of the previous answer's turn, the new user
message and the assistant header. The `[TURN]` line after each answer shows it (cached=).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Callable, TextIO

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.inference import kv_memory
from kestrel_cli.inference.engine import Engine
from kestrel_cli.inference.timing import TimingPrinter, format_turn
from kestrel_cli.text.tokenizer import TooManyTokens

HELP = """commands:
  /reset         forget the conversation (keeps the system message)
  /system TEXT   set the system message and start over; /system alone shows it
  /image PATH    attach an image to your next message (Qwen3-VL); repeat for several
  /video PATH    attach a video to your next message (Qwen3-VL); repeat for several
  /stats         tokens in the context, cache reuse, speed so far
  /help          this list
  /exit          leave (or Ctrl-D); Ctrl-C stops an answer"""


class ChatSession:
    """One conversation: its messages and the engine whose KV cache holds them."""

    def __init__(
        self,
        engine: Engine,
        system: str | None = None,
        sampling: dict | None = None,
        timing: TimingPrinter | None = None,
        out: TextIO | None = None,
        thinking=None,
        on_turn: Callable[[], None] | None = None,
    ):
        self.engine = engine
        self.on_turn = on_turn  # after each completed turn (--prompt-cache saves)
        self.thinking = thinking  # cli.ThinkingOptions: --think/--hide-thinking
        self.system = system
        self.sampling = dict(sampling or {})
        self.timing = timing or TimingPrinter(False)
        self.out = out or sys.stdout
        self.messages: list[dict] = []
        self.pending_images: list[str] = []  # /image files for the next user message
        self.pending_videos: list[str] = []  # /video (--video) files for it
        self.turn = 0
        self.last_stats = None
        self.totals = dict(
            prefill_tokens=0, cached_tokens=0, prefill_ms=0.0, decode_tokens=0, decode_ms=0.0
        )

    # -------------------------------------------------------------- state
    def conversation(self) -> list[dict]:
        sys_msg = [{"role": "system", "content": self.system}] if self.system is not None else []
        return sys_msg + self.messages

    def reset(self) -> None:
        self.messages = []
        self.pending_images = []
        self.pending_videos = []
        self.turn = 0
        self.engine.reset()

    def set_system(self, text: str) -> None:
        self.system = text
        self.reset()

    @property
    def ctx_used(self) -> int:
        return self.engine.cache.offset

    # -------------------------------------------------------------- one turn
    def say(self, text: str) -> None:
        self.timing.text(text, self.out)  # timing lines held off the answer's lines

    def ask(self, text: str) -> str | None:
        """Answer one user message, streaming it to `out`; the reply, or None when it did
        not fit. Ctrl-C (KeyboardInterrupt) stops the answer and keeps what was said."""
        eng = self.engine
        content = text
        if self.pending_images or self.pending_videos:
            content = (
                [{"type": "image", "image": f} for f in self.pending_images]
                + [{"type": "video", "video": f} for f in self.pending_videos]
                + [{"type": "text", "text": text}]
            )
            # used by this turn, whatever comes of it
            self.pending_images, self.pending_videos = [], []
        msgs = self.conversation() + [{"role": "user", "content": content}]
        try:  # counted up to the context, not further: a huge paste costs what fits
            ids = eng.encode_prompt(
                msgs,
                limit=eng.ctx_size - 1,
                **(self.thinking.template_kwargs() if self.thinking else {}),
            )
        except TooManyTokens as e:
            need = f"{'' if e.exact else 'at least '}{e.n_tokens}"
        else:
            need = None if len(ids) < eng.ctx_size else str(len(ids))  # images counted
        if need is not None:
            self.say(
                f"[context full: this turn needs {need} tokens, the context holds "
                f"{eng.ctx_size}; /reset to start over, or restart with a larger -c]\n"
            )
            return None
        # its KV cache must fit the memory available now (KestrelError: one line, next turn)
        tokens = min(eng.ctx_size, len(ids) + self.sampling.get("max_tokens", 256))
        kv_memory.check_request(eng, tokens, "a smaller -n/--n-predict or -c/--ctx-size")
        stats, finish = None, None
        # the reply kept in the history is the answer without its thinking, as Qwen3's
        # template expects of earlier turns
        from kestrel_cli.text.reasoning import ThinkingView

        view = self.thinking.view(eng, ids, self.out) if self.thinking else ThinkingView(tty=False)
        gen = eng.stream(ids, **self.sampling)
        try:
            for chunk in gen:
                if chunk.text:
                    self.say(view.feed(chunk.text))
                self.timing.token(chunk.timing)
                if chunk.stats is not None:
                    stats, finish = chunk.stats, chunk.finish_reason
            self.say(view.finish())
        except KeyboardInterrupt:
            gen.close()
            self.say(view.finish())
            self.say(" [interrupted]\n")
            self.timing.flush()
            reply = "".join(view.content)
            if reply:  # keep what was said, as a chat UI does
                self.messages += [
                    {"role": "user", "content": content},
                    {"role": "assistant", "content": reply},
                ]
                self.turn += 1
            return reply
        self.say("\n")
        reply = "".join(view.content)
        self.messages += [
            {"role": "user", "content": content},
            {"role": "assistant", "content": reply},
        ]
        self.turn += 1
        self.last_stats = stats
        for k in self.totals:
            self.totals[k] += getattr(stats, k)
        self.timing.perf(stats)
        self.timing.line(format_turn(self.turn, stats, self.ctx_used, eng.ctx_size))
        if self.on_turn is not None:
            self.on_turn()
        if finish == "length" and self.ctx_used >= eng.ctx_size:
            self.say("[context full: /reset to start over]\n")
        return reply

    def stats_text(self) -> str:
        t, eng = self.totals, self.engine
        lines = [
            f"turns: {self.turn}, messages: {len(self.messages)}",
            f"context: {self.ctx_used} / {eng.ctx_size} tokens, "
            f"KV cache {eng.cache.nbytes / 2**20:.1f} MiB",
            f"prompt tokens: {t['prefill_tokens']} prefilled, "
            f"{t['cached_tokens']} reused from the cache",
        ]
        if t["prefill_ms"] > 0:
            lines.append(f"prefill: {t['prefill_tokens'] / t['prefill_ms'] * 1e3:.1f} t/s")
        if t["decode_ms"] > 0:
            lines.append(
                f"decode: {t['decode_tokens']} tokens, "
                f"{t['decode_tokens'] / t['decode_ms'] * 1e3:.1f} t/s"
            )
        return "\n".join(lines)

    def attach_video(self, arg: str) -> None:
        """Attach a video to the next user message, its header checked first (not a video,
        too large, too many frames: one clear error, nothing kept)."""
        from kestrel_cli.models.video import probe_video

        path = str(Path(arg).expanduser())
        head = probe_video(path)
        self.engine.video_config().plan(head)  # the sampled frames fit the processor
        self.pending_videos.append(path)

    # -------------------------------------------------------------- slash commands
    def command(self, line: str) -> bool:
        """Run a /command; False means leave."""
        name, _, arg = line.partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit", "/bye"):
            return False
        if name == "/reset":
            self.reset()
            self.say("[conversation cleared]\n")
        elif name == "/system":
            if arg:
                self.set_system(arg)
                self.say("[system message set; conversation cleared]\n")
            else:
                self.say(
                    f"[system message: {self.system if self.system is not None else '(model default)'}]\n"
                )
        elif name == "/image":
            if not arg:
                self.say(
                    f"[usage: /image PATH; {len(self.pending_images)} image(s) attached "
                    f"to your next message]\n"
                )
            else:
                from kestrel_cli.models.images import probe_image

                path = str(Path(arg).expanduser())
                probe_image(path)  # not an image, too large: one clear error, nothing kept
                self.pending_images.append(path)
                self.say(f"[image {arg} attached to your next message]\n")
        elif name == "/video":
            if not arg:
                self.say(
                    f"[usage: /video PATH; {len(self.pending_videos)} video(s) attached "
                    f"to your next message]\n"
                )
            else:
                self.attach_video(arg)
                self.say(f"[video {arg} attached to your next message]\n")
        elif name == "/stats":
            self.say(self.stats_text() + "\n")
        elif name in ("/help", "/?"):
            self.say(HELP + "\n")
        else:
            self.say(f"[unknown command {name}; /help lists them]\n")
        return True


def _enable_line_editing() -> None:
    """Line editing and history for input() where the terminal supports it."""
    if not sys.stdin.isatty():
        return
    try:
        import readline  # noqa: F401  (importing it is what turns it on)
    except ImportError:
        pass


def repl(session: ChatSession, read: Callable[[str], str] = input) -> None:
    """Read lines until /exit or Ctrl-D; each is a command or a user turn."""
    _enable_line_editing()
    eng = session.engine
    session.say(
        f"kestrel chat: {eng.config.model_type} from {eng.path.name}, context "
        f"{eng.ctx_size} tokens. /help for commands, Ctrl-D to leave.\n"
    )
    while True:
        try:
            line = read("> ")
        except EOFError:
            session.say("\n")
            return
        except KeyboardInterrupt:  # Ctrl-C at the prompt: a fresh prompt
            session.say("\n")
            continue
        line = line.strip()
        if not line:
            continue
        try:
            if line.startswith("/"):
                if not session.command(line):
                    return
            else:
                session.ask(line)
        except KestrelError as e:
            session.say(f"[error: {' '.join(str(e).split())}]\n")
        except KeyboardInterrupt:  # between tokens and prompt: just go on
            session.say("\n")
