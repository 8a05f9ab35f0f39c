"""The `kestrel` command: a thin typer app over the library.

Commands parse options, call `Engine`, print. Model text goes to stdout, timing lines
(`[DEC-SINGLE]`, `[PERF]`: docs/DESIGN.md §4 Timing lines) to stderr. Every bad input ends as one
`error: ...` line on stderr and exit status 1 (usage errors: status 2), never a traceback.

Shared flags are defined once, as the fields of `EngineOptions` and `SamplingOptions`;
a command gets them all by declaring one parameter of that type and decorating itself
with `@with_options` (later commands such as `serve`, `bench`, `ppl` do the same):

    @app.command()
    @with_options
    def bench(engine: EngineOptions, n: int = 128):
        eng = engine_from_options(engine)
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import sys
import typing
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer
from typer.core import TyperGroup

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.inference import kv_memory
from kestrel_cli.inference.engine import (
    MAX_CTX,
    THREADS_FLOOR,
    THREADS_MAX,
    THREADS_PER_CORE,
    Engine,
    LoadOptions,
)
from kestrel_cli.inference.speculative import (
    DRAFT_MAX,
    DRAFT_MIN,
    DRAFT_P_MIN,
    NO_SPARSE,
    check_settings,
    inexact_note,
)
from kestrel_cli.inference.timing import TimingPrinter
from kestrel_cli.runtime.sparse import options_table
from kestrel_cli.text.tokenizer import TooManyTokens

# typer >= 0.20 vendors click as typer._click; take the exceptions from wherever typer does
_cx = sys.modules[typer.BadParameter.__module__]
_NoArgsIsHelp = getattr(_cx, "NoArgsIsHelpError", ())

SPINNER_BYTES = 200 << 20  # show a spinner while loading weights larger than this

# What the CLI reads is bounded: a file or stdin past its cap is refused with one line, and
# is read in pieces so that /dev/zero, a FIFO or a huge file never costs more than the cap.
MiB = 1 << 20
READ_PIECE = 1 * MiB
PROMPT_BYTES = 32 * MiB  # -f FILE, -p - / -f -: the server's request body cap
PPL_BYTES = 16 * MiB  # ppl -f: tokenising costs ~170 bytes a byte of text at
# its peak (8 MiB: 1.4 GiB); wikitext-2's train split fits
SCHEMA_BYTES = 1 * MiB  # --json-schema (the server takes 64 KiB of schema)
CHAT_LINE_BYTES = PROMPT_BYTES  # one chat line read from a pipe or file
# Threads: OpenMP starts -t threads per engine; past a few per core they only contend, and
# enough of them fail to start (libgomp: "Thread creation failed", or a segfault)
MAX_PARALLEL = 64  # serve --parallel: each slot a thread, a KV cache, -t threads

_MODEL, _SAMPLING, _OUTPUT, _PROMPT = "Model", "Sampling", "Output", "Prompt"
_DRAFT = "Speculative decoding"
# --sparse's help: the presets and options, one table (kestrel_cli.runtime.sparse.OPTIONS); rich
# keeps the lines when they are separated by blank ones
_SPARSE_TABLE = "\n\n" + "\n\n".join(options_table().splitlines())


class Act(str, Enum):
    f32 = "f32"
    q8 = "q8"


class Quant(str, Enum):
    none = "none"
    q8 = "q8"
    q4 = "q4"


class GGUFType(str, Enum):
    q8_0 = "q8_0"
    q4_0 = "q4_0"
    q4_1 = "q4_1"
    q4_k_m = "q4_k_m"
    q5_k_m = "q5_k_m"
    q6_k = "q6_k"


class VisionDtype(str, Enum):
    auto = "auto"
    f32 = "f32"
    bf16 = "bf16"


class MmprojType(str, Enum):
    f32 = "f32"
    f16 = "f16"
    bf16 = "bf16"
    q8_0 = "q8_0"


# ---------------------------------------------------------------------------- shared flags


@dataclass
class EngineOptions:
    """Flags of every command that builds an Engine (`LoadOptions` on the library side)."""

    model: Annotated[
        Optional[Path],
        typer.Option(
            "-m",
            "--model",
            help="Checkpoint directory or .gguf file.",
            show_default="bundled SmolLM2-135M-Instruct",
            rich_help_panel=_MODEL,
        ),
    ] = None
    mmproj: Annotated[
        Optional[Path],
        typer.Option(
            "--mmproj",
            metavar="FILE",
            help="Qwen3-VL's vision tower for a GGUF model: llama.cpp's mmproj GGUF (f32, "
            "f16, bf16 or q8_0). Without it, the one mmproj*.gguf beside a Qwen3-VL GGUF is "
            "used (several: none is guessed).",
            show_default=False,
            rich_help_panel=_MODEL,
        ),
    ] = None
    vision_dtype: Annotated[
        VisionDtype,
        typer.Option(
            "--vision-dtype",
            help="Qwen3-VL's vision tower: bf16 = bf16 matmuls and attention (AVX512-BF16 "
            "only; faster, ~1e-2 relative error in the image embeddings); f32 = "
            "exact float32; auto = bf16 where the CPU has it, else f32. The text model stays "
            "exact.",
            rich_help_panel=_MODEL,
        ),
    ] = VisionDtype.auto
    ctx_size: Annotated[
        Optional[int],
        typer.Option(
            "-c",
            "--ctx-size",
            help=f"Context size in tokens (at most {MAX_CTX}). The KV cache takes memory as "
            "tokens arrive: a request whose cache would not fit the memory available is "
            "refused before its prefill.",
            show_default="the model's",
            rich_help_panel=_MODEL,
        ),
    ] = None
    threads: Annotated[
        Optional[int],
        typer.Option(
            "-t",
            "--threads",
            help=f"CPU threads: at most {THREADS_PER_CORE} per core, "
            f"{THREADS_FLOOR} allowed on any machine, never more than {THREADS_MAX}. On a "
            "big.LITTLE CPU as many threads as there are big cores run pinned to them; more run "
            "unpinned on all cores (`kestrel cpus` shows them).",
            show_default="all available cores",
            rich_help_panel=_MODEL,
        ),
    ] = None
    quant: Annotated[
        Quant, typer.Option("--quant", help="Quantise the weights at load.", rich_help_panel=_MODEL)
    ] = Quant.none
    kv_q8: Annotated[
        bool, typer.Option("--kv-q8", help="Store the KV cache as int8.", rich_help_panel=_MODEL)
    ] = False
    kv_f16: Annotated[
        bool,
        typer.Option(
            "--kv-f16",
            help="Store the KV cache as float16 (not with --kv-q8).",
            rich_help_panel=_MODEL,
        ),
    ] = False
    sparse_attn: Annotated[
        bool,
        typer.Option(
            "--sparse-attn", help="Block-sparse decode attention.", rich_help_panel=_MODEL
        ),
    ] = False
    sparse_k: Annotated[
        int,
        typer.Option(
            "--sparse-k",
            help="Blocks of 32 tokens each query head attends to (--sparse-attn).",
            rich_help_panel=_MODEL,
        ),
    ] = 32
    sparse_probes: Annotated[
        int,
        typer.Option(
            "--sparse-probes", help="Keys probed per block (--sparse-attn).", rich_help_panel=_MODEL
        ),
    ] = 8
    sparse: Annotated[
        Optional[str],
        typer.Option(
            "--sparse",
            metavar="NAME|OPT+OPT+...",
            help="Sparse options, implies --sparse-attn: "
            "a preset, or options joined by + applied in order (a preset among them: "
            "quality+recent=2). " + _SPARSE_TABLE,
            show_default="none",
            rich_help_panel=_MODEL,
        ),
    ] = None
    act: Annotated[
        Act,
        typer.Option(
            "--act",
            help="Activations of quantised matmuls: q8 = int8 blocks of 32 as "
            "llama.cpp (the fast path, not exact); f32 = float32 (exact).",
            rich_help_panel=_MODEL,
        ),
    ] = Act.q8

    repack: Annotated[
        bool,
        typer.Option(
            "--repack/--no-repack",
            help="At load, interleave q4_0/q4_1/q4_k/q6_k/q8_0 weights by 16 "
            "rows (the decode GEMV's layout) and copy the other weights decode reads, but an "
            "untied embedding, into memory on huge pages; the results are the same. MoE experts "
            "are repacked too when the weights fit the free memory, else they stay mapped, with "
            "a note. --no-repack keeps the file's row-major layout as mapped pages.",
            rich_help_panel=_MODEL,
        ),
    ] = True

    def load_options(self) -> LoadOptions:
        """The Engine's options these flags give (-c default: the model's context)."""
        return LoadOptions(
            kv_q8=self.kv_q8,
            sparse_attn=self.sparse_attn,
            sparse_k=self.sparse_k,
            sparse_probes=self.sparse_probes,
            quant=Quant(self.quant).value,
            threads=self.threads,
            ctx_size=self.ctx_size,
            act=Act(self.act).value,
            kv_f16=self.kv_f16,
            repack=self.repack,
            sparse=self.sparse,
            mmproj=self.mmproj,
            vision_dtype=VisionDtype(self.vision_dtype).value,
        )

    def check(self) -> None:
        """Fail fast, before any file is read (the Engine's own validation, the bounds of
        what this machine can start included)."""
        self.load_options().validate()


@dataclass
class SamplingOptions:
    """Generation flags, llama.cpp's defaults."""

    n_predict: Annotated[
        int,
        typer.Option(
            "-n",
            "--n-predict",
            help="Tokens to generate; -1 = until EOS or the context is full.",
            rich_help_panel=_SAMPLING,
        ),
    ] = 256
    temp: Annotated[
        float, typer.Option("--temp", help="Temperature; 0 = greedy.", rich_help_panel=_SAMPLING)
    ] = 0.8
    top_k: Annotated[
        int,
        typer.Option(
            "--top-k", help="Keep the k most likely tokens; 0 = all.", rich_help_panel=_SAMPLING
        ),
    ] = 40
    top_p: Annotated[
        float,
        typer.Option(
            "--top-p",
            help="Keep the most likely tokens up to this probability mass (nucleus "
            "sampling); 1.0 = all.",
            rich_help_panel=_SAMPLING,
        ),
    ] = 0.95
    min_p: Annotated[
        float,
        typer.Option(
            "--min-p",
            help="Drop tokens below min_p x the top probability.",
            rich_help_panel=_SAMPLING,
        ),
    ] = 0.05
    repeat_penalty: Annotated[
        float,
        typer.Option(
            "--repeat-penalty",
            help="Penalty on the last 64 tokens; 1.0 = off.",
            rich_help_panel=_SAMPLING,
        ),
    ] = 1.0
    seed: Annotated[
        Optional[int],
        typer.Option(
            "--seed",
            help="Random seed (0..2^64-1; -1 = random, as llama.cpp).",
            show_default="random",
            rich_help_panel=_SAMPLING,
        ),
    ] = None
    ignore_eos: Annotated[
        bool,
        typer.Option(
            "--ignore-eos",
            help="Keep generating past the end-of-sequence token.",
            rich_help_panel=_SAMPLING,
        ),
    ] = False

    def check(self) -> None:
        from kestrel_cli.inference.sampling import check_params

        if self.n_predict < -1:
            raise KestrelError(
                f"-n/--n-predict must be >= -1 (-1 = until EOS), got {self.n_predict}"
            )
        check_params(self.temp, self.top_k, self.top_p, self.min_p, self.repeat_penalty)
        if self.seed == -1:  # llama.cpp's "random"
            self.seed = None
        if self.seed is not None and not 0 <= self.seed < 1 << 64:
            raise KestrelError(f"--seed must be in 0..2^64-1 (or -1 = random), got {self.seed}")

    def stream_kwargs(self, engine: Engine) -> dict:
        """Keyword arguments for `Engine.stream`."""
        return dict(
            max_tokens=engine.ctx_size if self.n_predict < 0 else self.n_predict,
            temperature=self.temp,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repeat_penalty=self.repeat_penalty,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )


@dataclass
class OutputOptions:
    timing: Annotated[
        bool,
        typer.Option(
            "--timing/--no-timing",
            help="Print the [DEC-SINGLE] and [PERF] timing lines on stderr.",
            rich_help_panel=_OUTPUT,
        ),
    ] = True


def check_reasoning_budget(n: int) -> None:
    if n < -1:
        raise KestrelError(
            f"--reasoning-budget must be >= -1 (-1 = unlimited, 0 = no thinking), got {n}"
        )


@dataclass
class DraftOptions:
    """Speculative decoding: a small draft model proposes, the model checks in one pass."""

    draft: Annotated[
        Optional[Path],
        typer.Option(
            "--draft",
            "-md",
            help="A draft model (checkpoint directory or .gguf file) with the same tokenizer: "
            "it proposes the next tokens, the model checks them in one pass; the output is "
            "the model's own (greedy: the same text), faster when the draft guesses well. "
            "Loaded with the same thread, --act and KV cache flags; not with sparse "
            "attention or images.",
            show_default="none",
            rich_help_panel=_DRAFT,
        ),
    ] = None
    draft_max: Annotated[
        int,
        typer.Option(
            "--draft-max",
            help="Tokens the draft proposes per step at most (llama.cpp's is 16; 15 makes the "
            "check pass 16 rows, each then computed as one-token decoding computes it; long "
            "guesses pay while the draft keeps being right).",
            rich_help_panel=_DRAFT,
        ),
    ] = DRAFT_MAX
    draft_min: Annotated[
        int,
        typer.Option(
            "--draft-min",
            help="A proposal shorter than this is not checked (a plain step instead).",
            rich_help_panel=_DRAFT,
        ),
    ] = DRAFT_MIN
    draft_p_min: Annotated[
        float,
        typer.Option(
            "--draft-p-min",
            help="The draft stops proposing at a token it gives less than this "
            "probability; 0: always --draft-max. Low, as a check pass costs nearly as "
            "much for a few rows as for many (llama.cpp's 0.75 cuts most of the gain).",
            rich_help_panel=_DRAFT,
        ),
    ] = DRAFT_P_MIN

    def check(self, engine: EngineOptions, images=None, videos=None) -> None:
        """Fail fast, before any file is read."""
        if self.draft is None:
            return
        check_settings(self.draft_max, self.draft_min, self.draft_p_min)
        if engine.sparse_attn or engine.sparse is not None:
            raise KestrelError(NO_SPARSE)
        if images:
            raise KestrelError("--draft does not take images (--image): the draft reads text only")
        if videos:
            raise KestrelError("--draft does not take videos (--video): the draft reads text only")

    def attach(self, eng: Engine, engine: EngineOptions) -> None:
        """Load the draft (the model's load options, its context size and threads) and
        make `eng` decode with it."""
        if self.draft is None:
            return
        load = dataclasses.replace(  # the draft reads text: no vision tower
            engine.load_options(), ctx_size=eng.ctx_size, threads=eng.threads, mmproj=None
        )
        eng.set_draft(
            Engine.load(self.draft, load),
            n_max=self.draft_max,
            n_min=self.draft_min,
            p_min=self.draft_p_min,
        )
        note = inexact_note(eng, self.draft_max)
        if note:
            print(f"note: {note}", file=sys.stderr)


@dataclass
class ThinkingOptions:
    """Hybrid-thinking models (Qwen3): the template's switch and how the thinking shows."""

    think: Annotated[
        Optional[bool],
        typer.Option(
            "--think/--no-think",
            help="Turn the model's thinking on or off (the chat template's enable_thinking).",
            show_default="the template's",
            rich_help_panel=_PROMPT,
        ),
    ] = None
    hide_thinking: Annotated[
        bool,
        typer.Option(
            "--hide-thinking",
            help="Leave the <think> block out of the output (on a terminal it is shown dimmed).",
            rich_help_panel=_OUTPUT,
        ),
    ] = False
    reasoning_budget: Annotated[
        int,
        typer.Option(
            "--reasoning-budget",
            metavar="N",
            help="At most N tokens of thinking, then the <think> block is closed and the "
            "answer follows (llama.cpp's flag): -1 = unlimited, 0 = no thinking.",
            rich_help_panel=_PROMPT,
        ),
    ] = -1

    def check(self) -> None:
        check_reasoning_budget(self.reasoning_budget)
        if self.think and self.reasoning_budget == 0:
            raise KestrelError("--think and --reasoning-budget 0 contradict each other")

    def template_kwargs(self) -> dict:
        if self.think is None:  # budget 0: the template's empty think block
            return {"enable_thinking": False} if self.reasoning_budget == 0 else {}
        return {"enable_thinking": self.think}

    def stream_kwargs(self) -> dict:
        """Keyword arguments for `Engine.stream`."""
        return {"reasoning_budget": self.reasoning_budget}

    def view(self, eng: Engine, ids, out=None):
        """The ThinkingView of an answer to the prompt `ids`."""
        from kestrel_cli.inference.timing import _isatty
        from kestrel_cli.text.reasoning import ThinkingView, prompt_opens_thinking

        try:
            tail = eng.tokenizer.decode([int(t) for t in list(ids)[-4:]])
        except (TypeError, ValueError):
            tail = ""
        return ThinkingView(
            _isatty(out if out is not None else sys.stdout),
            self.hide_thinking,
            prompt_opens_thinking(tail),
        )


def with_options(fn):
    """Expand each parameter of `fn` typed as an options dataclass into that dataclass's
    flags; `fn` receives one instance per such parameter."""
    hints = typing.get_type_hints(fn, include_extras=True)
    params, groups = [], {}
    for p in inspect.signature(fn).parameters.values():
        cls = hints.get(p.name)
        if isinstance(cls, type) and dataclasses.is_dataclass(cls):
            fhints = typing.get_type_hints(cls, include_extras=True)
            names = [f.name for f in dataclasses.fields(cls)]
            params += [
                inspect.Parameter(
                    f.name,
                    inspect.Parameter.KEYWORD_ONLY,
                    default=f.default,
                    annotation=fhints[f.name],
                )
                for f in dataclasses.fields(cls)
            ]
            groups[p.name] = (cls, names)
        else:
            params.append(
                p.replace(
                    kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints.get(p.name, p.annotation)
                )
            )
    # own flags first, then the groups in declaration order (that is the --help order)
    own = [p for p in params if not any(p.name in n for _, n in groups.values())]
    params = own + [p for p in params if p not in own]

    @functools.wraps(fn)
    def command(**kw):
        for arg, (cls, names) in groups.items():
            kw[arg] = cls(**{n: kw.pop(n) for n in names})
        return fn(**kw)

    command.__signature__ = inspect.Signature(params)
    command.__annotations__ = {p.name: p.annotation for p in params}
    return command


def _model_bytes(path: Path | None) -> int:
    from kestrel_cli.models.loader import default_model_path

    try:
        p = default_model_path() if path is None else Path(path).expanduser()
        if p.is_dir():
            return sum(f.stat().st_size for f in p.glob("*.safetensors"))
        return p.stat().st_size
    except (OSError, KestrelError):
        return 0  # from_pretrained reports it properly


def check_kv_memory(eng: Engine, tokens: int, slots: int = 1, hint: str = "") -> None:
    """Refuse at start when `slots` KV caches of `tokens` tokens and the weights could never
    fit this machine's RAM (kv_memory.check_ram)."""
    kv_memory.check_ram(eng, tokens, slots, hint)


def engine_from_options(opts: EngineOptions, spinner: bool = True, slots: int = 1) -> Engine:
    """Build the Engine the flags describe (a spinner on stderr for big models), refused
    when `slots` KV caches of an explicit -c (or of --parallel slots) could never fit the
    RAM (check_kv_memory); the model's own context costs memory only as it is used, and each
    request is checked when its tokens are known (kv_memory.check_request)."""
    load = opts.load_options()  # Engine.load validates it
    size = _model_bytes(opts.model)
    if spinner and size > SPINNER_BYTES and sys.stderr.isatty():
        from rich.console import Console

        name = "bundled model" if opts.model is None else Path(opts.model).name
        with Console(stderr=True).status(f"loading {name} ({size / 2**20:.0f} MiB)"):
            eng = Engine.load(opts.model, load)
    else:
        eng = Engine.load(opts.model, load)
    for line in eng.notices:
        print(f"note: {line}", file=sys.stderr)
    # big.LITTLE: which cores the threads run on (machines whose cores are alike: nothing)
    if eng.thread_plan is not None and eng.thread_plan.mixed:
        print(eng.thread_plan.line, file=sys.stderr)
    if opts.ctx_size is not None:
        check_kv_memory(
            eng,
            eng.ctx_size,
            slots,
            "--parallel or -c/--ctx-size" if slots > 1 else "-c/--ctx-size",
        )
    return eng


# ---------------------------------------------------------------------------- the app


class _Group(TyperGroup):
    """Turns every failure into one line on stderr: `error: ...`."""

    def main(self, args=None, prog_name=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args=args, prog_name=prog_name, standalone_mode=False, **extra)
        try:
            rv = super().main(args=args, prog_name=prog_name, standalone_mode=False, **extra)
        except _NoArgsIsHelp as e:
            print(e.ctx.get_help())
            sys.exit(0)
        except _cx.UsageError as e:
            hint = f" (see '{e.ctx.command_path} --help')" if e.ctx is not None else ""
            _fail(e.format_message().replace("Value error, ", "") + hint, e.exit_code)
        except _cx.ClickException as e:
            _fail(e.format_message(), e.exit_code)
        except typer.Abort:
            _fail("aborted", 1)
        except KestrelError as e:
            _fail(str(e), 1)
        except OSError as e:
            _fail(f"{e.strerror or e}" + (f": {e.filename}" if e.filename else ""), 1)
        except MemoryError:
            _fail("out of memory", 1)
        sys.exit(rv if isinstance(rv, int) else 0)


def _fail(message: str, code: int) -> typing.NoReturn:
    print(f"error: {' '.join(str(message).split())}", file=sys.stderr)
    sys.exit(code)


app = typer.Typer(
    cls=_Group,
    name="kestrel",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
    help="Kestrel runs LLMs on the CPU (Llama, Qwen2/2.5 and the Qwen3 family).",
)


def read_bounded(f, cap: int, what: str) -> bytearray:
    """All of the binary file object `f`, read in pieces of at most READ_PIECE bytes;
    KestrelError "WHAT is larger than N MiB" once it passes `cap` bytes (so /dev/zero, a
    FIFO that never closes or a huge file hold at most cap + 1 bytes)."""
    buf = bytearray()
    while True:
        piece = f.read(min(READ_PIECE, cap + 1 - len(buf)))
        if not piece:
            return buf
        buf += piece
        if len(buf) > cap:
            raise KestrelError(f"{what} is larger than {cap // MiB} MiB")


def read_file_bounded(path, cap: int, what: str) -> bytearray:
    """read_bounded of the file at `path` (OSError as from open())."""
    with open(path, "rb") as f:
        return read_bounded(f, cap, what)


def read_prompt(
    prompt: str | None, file: Path | None, cap: int = PROMPT_BYTES, what: str = "prompt"
) -> str:
    """The prompt text from -p TEXT, -f FILE, or stdin (-p - / -f -); a file or stdin of
    more than `cap` bytes is refused (`what` names the text in the messages)."""
    if prompt is not None and file is not None:
        raise KestrelError("give the prompt with -p or -f, not both")
    if prompt is None and file is None:
        raise KestrelError("no prompt: give -p TEXT, -f FILE, or -p - to read stdin")
    if prompt == "-" or (file is not None and str(file) == "-"):
        try:
            text = read_bounded(sys.stdin.buffer, cap, f"the {what} on stdin").decode("utf-8")
        except UnicodeDecodeError as e:
            raise KestrelError(f"the {what} on stdin is not UTF-8 text (byte {e.start})") from None
    elif file is not None:
        try:
            text = read_file_bounded(file, cap, f"{what} file {file}").decode("utf-8")
        except OSError as e:
            raise KestrelError(f"cannot read {what} file {file}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise KestrelError(f"{what} file {file} is not UTF-8 text") from None
    else:
        text = prompt
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # argv bytes that were not UTF-8 (surrogate-escaped)
            raise KestrelError(f"-p/--prompt is not UTF-8 text (character {e.start})") from None
    if text.endswith("\n"):  # a file's last newline is not part of the prompt
        text = text[:-2] if text.endswith("\r\n") else text[:-1]  # (as llama.cpp's -f)
    if not text.strip():
        raise KestrelError("empty prompt")
    return text


@app.command()
@with_options
def run(
    prompt: Annotated[
        Optional[str],
        typer.Option(
            "-p",
            "--prompt",
            help=f"Prompt text; '-' reads stdin (at most {PROMPT_BYTES // MiB} MiB).",
            rich_help_panel=_PROMPT,
        ),
    ] = None,
    file: Annotated[
        Optional[Path],
        typer.Option(
            "-f",
            "--file",
            help=f"Read the prompt from a file (at most {PROMPT_BYTES // MiB} MiB).",
            rich_help_panel=_PROMPT,
        ),
    ] = None,
    system: Annotated[
        Optional[str],
        typer.Option(
            "-s", "--system", help="System message (chat template).", rich_help_panel=_PROMPT
        ),
    ] = None,
    raw: Annotated[
        bool,
        typer.Option(
            "--raw", help="Send the text as is, without the chat template.", rich_help_panel=_PROMPT
        ),
    ] = False,
    image: Annotated[
        Optional[list[Path]],
        typer.Option(
            "--image",
            help="An image file (JPEG, PNG, WebP) shown before the prompt; repeat "
            "for several (Qwen3-VL).",
            rich_help_panel=_PROMPT,
        ),
    ] = None,
    video: Annotated[
        Optional[list[Path]],
        typer.Option(
            "--video",
            help="A video file (MP4, MOV, WebM, MKV, AVI) shown before the prompt, frames "
            "sampled as the checkpoint's video processor says; repeat for several (Qwen3-VL).",
            rich_help_panel=_PROMPT,
        ),
    ] = None,
    json_schema: Annotated[
        Optional[Path],
        typer.Option(
            "--json-schema",
            help="A JSON schema file: the answer is JSON matching it, enforced "
            f"while sampling (llguidance); '{{}}' in the file = any JSON object. At most "
            f"{SCHEMA_BYTES // MiB} MiB.",
            rich_help_panel=_OUTPUT,
        ),
    ] = None,
    prompt_cache: Annotated[
        Optional[Path],
        typer.Option(
            "--prompt-cache",
            help="A file to keep the prompt's KV cache in (llama.cpp's flag): when it exists "
            "and matches the model and cache options, the prompt's longest prefix it holds is "
            "not computed again; the prompt is saved to it once processed.",
            rich_help_panel=_PROMPT,
        ),
    ] = None,
    engine: EngineOptions = None,
    sampling: SamplingOptions = None,
    output: OutputOptions = None,
    thinking: ThinkingOptions = None,
    draft: DraftOptions = None,
):
    """Generate the reply to one prompt and stream it to stdout."""
    engine.check()
    sampling.check()
    thinking.check()
    draft.check(engine, image, video)
    if raw and system is not None:
        raise KestrelError("-s/--system needs the chat template; drop --raw")
    if raw and (thinking.think is not None or thinking.hide_thinking):
        raise KestrelError("--think/--no-think/--hide-thinking need the chat template; drop --raw")
    if raw and image:
        raise KestrelError("--image needs the chat template; drop --raw")
    if raw and video:
        raise KestrelError("--video needs the chat template; drop --raw")
    for f in image or []:
        if not Path(f).expanduser().is_file():
            raise KestrelError(f"image {f}: no such file")
    for f in video or []:
        if not Path(f).expanduser().is_file():
            raise KestrelError(f"video {f}: no such file")
    schema = None
    if json_schema is not None:
        import json

        try:
            schema = json.loads(
                read_file_bounded(json_schema, SCHEMA_BYTES, f"--json-schema {json_schema}").decode(
                    "utf-8"
                )
            )
        except OSError as e:
            raise KestrelError(
                f"cannot read --json-schema {json_schema}: {e.strerror or e}"
            ) from None
        except (ValueError, UnicodeDecodeError) as e:
            raise KestrelError(f"--json-schema {json_schema} is not JSON: {e}") from None
        except RecursionError:  # json's decoder recurses once per nesting level
            raise KestrelError(
                f"--json-schema {json_schema} is not JSON: nested too deeply "
                f"(past Python's recursion limit)"
            ) from None
        if not isinstance(schema, dict):
            raise KestrelError(f"--json-schema {json_schema}: a schema is a JSON object")
        schema = schema or {"type": "object"}
        if thinking.think is None and not raw:
            thinking.think = False  # the answer is JSON from its first token
    check_prompt_cache(prompt_cache)
    text = read_prompt(prompt, file)
    eng = engine_from_options(engine)
    draft.attach(eng, engine)
    # a prompt longer than this cannot fit the context: refused before it is tokenised
    n_chars = len(text) + len(system or "")
    if n_chars > eng.tokenizer.max_text_chars(eng.ctx_size):
        raise KestrelError(
            f"the prompt has {n_chars} characters, more than a context of "
            f"{eng.ctx_size} tokens can hold (raise -c/--ctx-size)"
        )
    if raw:
        request = text
    else:
        content = (
            text
            if not (image or video)
            else [{"type": "image", "image": str(f)} for f in image or []]
            + [{"type": "video", "video": str(f)} for f in video or []]
            + [{"type": "text", "text": text}]
        )
        request = ([{"role": "system", "content": system}] if system is not None else []) + [
            {"role": "user", "content": content}
        ]
    tp = TimingPrinter(output.timing)
    out = sys.stdout
    stats = None
    try:  # counted up to the context, not further
        ids = eng.encode_prompt(request, limit=eng.ctx_size, **thinking.template_kwargs())
    except TooManyTokens as e:
        raise KestrelError(
            f"prompt has {'' if e.exact else 'at least '}{e.n_tokens} tokens, "
            f"more than the context size {eng.ctx_size} (raise -c/--ctx-size)"
        ) from None
    kw = sampling.stream_kwargs(eng)  # its KV cache must fit the memory available now
    kv_memory.check_request(
        eng,
        min(eng.ctx_size, len(ids) + kw["max_tokens"]),
        "a smaller -n/--n-predict or -c/--ctx-size",
    )
    view = None if raw else thinking.view(eng, ids, out)
    saved = prompt_cache is None
    if prompt_cache is not None:
        load_prompt_cache(eng, prompt_cache)
    try:
        for chunk in eng.stream(ids, **kw, **thinking.stream_kwargs(), json_schema=schema):
            tp.text(view.feed(chunk.text) if view else chunk.text, out)
            if not saved:  # the prompt is processed: saved now, as llama.cpp does
                saved = True
                tp.flush()
                save_prompt_cache(eng, prompt_cache, len(ids))
            tp.token(chunk.timing)
            stats = chunk.stats or stats
        if view:
            tp.text(view.finish(), out)
    except KeyboardInterrupt:
        if view:
            tp.text(view.finish(), out)
        tp.text("\n", out)
        tp.flush()
        print("interrupted", file=sys.stderr)
        raise typer.Exit(130)
    tp.text("\n", out)
    if stats is not None:
        tp.perf(stats)


def check_prompt_cache(path: Path | None) -> None:
    """--prompt-cache: its directory must exist (checked before the model is loaded)."""
    if path is not None and not Path(path).expanduser().resolve().parent.is_dir():
        raise KestrelError(f"--prompt-cache {path}: no such directory")


def load_prompt_cache(eng: Engine, path: Path) -> None:
    """--prompt-cache: load the file into the engine's cache when it exists (a missing
    file is made after the prompt, as llama.cpp does); a file that does not match is an
    error."""
    path = Path(path).expanduser()
    if not path.exists():
        return
    import time

    t0 = time.perf_counter()
    n, size = eng.load_cache(path)
    ms = (time.perf_counter() - t0) * 1e3
    print(
        f"prompt cache {path}: {n} tokens loaded ({size / 2**20:.1f} MiB in {ms:.0f} ms)",
        file=sys.stderr,
    )


def save_prompt_cache(eng: Engine, path: Path, n_tokens: int | None = None) -> None:
    eng.save_cache(Path(path).expanduser(), n_tokens)


@app.command()
@with_options
def chat(
    system: Annotated[
        Optional[str],
        typer.Option(
            "-s", "--system", help="System message (chat template).", rich_help_panel=_PROMPT
        ),
    ] = None,
    prompt_cache: Annotated[
        Optional[Path],
        typer.Option(
            "--prompt-cache",
            help="A file to keep the prompt's KV cache in (llama.cpp's flag): when it exists "
            "and matches the model and cache options, the prompt's longest prefix it holds is "
            "not computed again; the conversation is saved to it after each turn.",
            rich_help_panel=_PROMPT,
        ),
    ] = None,
    video: Annotated[
        Optional[list[Path]],
        typer.Option(
            "--video",
            help="A video file (MP4, MOV, WebM, MKV, AVI) attached to your first message; "
            "repeat for several (Qwen3-VL). /video PATH attaches one to the next.",
            rich_help_panel=_PROMPT,
        ),
    ] = None,
    engine: EngineOptions = None,
    sampling: SamplingOptions = None,
    output: OutputOptions = None,
    thinking: ThinkingOptions = None,
    draft: DraftOptions = None,
):
    """Chat with the model, turn by turn; /help lists the commands, Ctrl-D leaves."""
    from kestrel_cli.apps.chat import ChatSession, repl

    engine.check()
    sampling.check()
    thinking.check()
    draft.check(engine, videos=video)
    check_prompt_cache(prompt_cache)
    for f in video or []:
        if not Path(f).expanduser().is_file():
            raise KestrelError(f"video {f}: no such file")
    eng = engine_from_options(engine)
    draft.attach(eng, engine)
    if prompt_cache is not None:
        load_prompt_cache(eng, prompt_cache)
    session = ChatSession(
        eng,
        system=system,
        sampling={**sampling.stream_kwargs(eng), **thinking.stream_kwargs()},
        timing=TimingPrinter(output.timing),
        thinking=thinking,
        on_turn=None if prompt_cache is None else lambda: save_prompt_cache(eng, prompt_cache),
    )
    for f in video or []:  # checked as /video does: header, frames, size; none decoded
        session.attach_video(str(f))
    repl(session, read=chat_reader(session))


def chat_reader(session) -> typing.Callable[[str], str]:
    """`kestrel chat`'s line reader for chat.repl. On a terminal input() (line editing;
    the terminal bounds a line). From a pipe or file a line is read with a bound: one of
    more than CHAT_LINE_BYTES (/dev/zero has no newline) ends the chat with an error. A
    message not UTF-8, or longer than the context can hold, is refused before it is
    tokenised, and the next line is read."""
    eng = session.engine
    max_chars = eng.tokenizer.max_text_chars(eng.ctx_size)

    def read(prompt: str) -> str:
        while True:
            if sys.stdin.isatty():
                line = input(prompt)
            else:
                sys.stdout.write(prompt)
                sys.stdout.flush()
                raw = sys.stdin.buffer.readline(CHAT_LINE_BYTES + 1)
                if not raw:
                    raise EOFError
                if len(raw) > CHAT_LINE_BYTES and not raw.endswith(b"\n"):
                    raise KestrelError(
                        f"a chat line on stdin is larger than {CHAT_LINE_BYTES // MiB} MiB"
                    )
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    session.say(f"[error: the message is not UTF-8 text (byte {e.start})]\n")
                    continue
            n_chars = len(line.strip())
            if n_chars > max_chars:
                session.say(
                    f"[error: the message has {n_chars} characters, more "
                    f"than a context of {eng.ctx_size} tokens can hold (start the "
                    f"chat with a larger -c/--ctx-size)]\n"
                )
                continue
            return line

    return read


@app.command()
@with_options
def serve(
    host: Annotated[
        str,
        typer.Option(
            "--host",
            help="Address to listen on; 0.0.0.0 opens it to the network.",
            rich_help_panel="Server",
        ),
    ] = "127.0.0.1",
    port: Annotated[
        int, typer.Option("--port", help="TCP port to listen on.", rich_help_panel="Server")
    ] = 8080,
    api_key: Annotated[
        Optional[str],
        typer.Option(
            "--api-key",
            envvar="KESTREL_API_KEY",
            show_default="none",
            help="Require 'Authorization: Bearer KEY' on /v1/* (or set KESTREL_API_KEY).",
            rich_help_panel="Server",
        ),
    ] = None,
    parallel: Annotated[
        int,
        typer.Option(
            "--parallel",
            help="Requests generated at once (slots): each has its own KV cache and prompt "
            "prefix; their tokens are decoded together, one pass over the weights a step, on the "
            f"-t threads. At most {MAX_PARALLEL}; N KV caches of the context must fit the memory.",
            rich_help_panel="Server",
        ),
    ] = 1,
    queue_size: Annotated[
        int,
        typer.Option(
            "--queue-size",
            help="Requests that may wait for a free engine; more get 503.",
            rich_help_panel="Server",
        ),
    ] = 32,
    shutdown_timeout: Annotated[
        float,
        typer.Option(
            "--shutdown-timeout",
            help="On SIGINT/SIGTERM, seconds in-flight requests get to "
            "finish before they end with an error (a stream: an error event and [DONE]).",
            rich_help_panel="Server",
        ),
    ] = 5.0,
    max_connections: Annotated[
        int,
        typer.Option(
            "--max-connections",
            help="Connections open at once at most; one more gets 503 and is closed.",
            rich_help_panel="Server limits",
        ),
    ] = 64,
    timeout_header: Annotated[
        float,
        typer.Option(
            "--timeout-header",
            help="Seconds a request's line and headers may take to arrive "
            "(and a new connection to start one); then 408 and the connection is closed.",
            rich_help_panel="Server limits",
        ),
    ] = 10.0,
    timeout_body: Annotated[
        float,
        typer.Option(
            "--timeout-body",
            help="Seconds a request's body may take to arrive; then 408.",
            rich_help_panel="Server limits",
        ),
    ] = 30.0,
    timeout_keep_alive: Annotated[
        float,
        typer.Option(
            "--timeout-keep-alive",
            help="Seconds an idle connection is kept between requests.",
            rich_help_panel="Server limits",
        ),
    ] = 5.0,
    request_timeout: Annotated[
        float,
        typer.Option(
            "--request-timeout",
            help="Seconds one request may take from admission to its last "
            "token (queue wait included); then 504, or an error event in a stream. 0: no limit.",
            rich_help_panel="Server limits",
        ),
    ] = 600.0,
    memory_budget: Annotated[
        Optional[str],
        typer.Option(
            "--memory-budget",
            help="Memory that requests being read and prepared (body, "
            "template, tokens, images, grammars) may hold at once, e.g. 4G; one more gets 503 "
            "with Retry-After. Weights and KV caches are not part of it.",
            show_default="a quarter of the RAM",
            rich_help_panel="Server limits",
        ),
    ] = None,
    max_request_memory: Annotated[
        Optional[str],
        typer.Option(
            "--max-request-memory",
            help="Memory one request may hold while it is read and "
            "prepared, e.g. 512M; a larger one gets 413 before any work.",
            show_default="1G, or the budget if smaller",
            rich_help_panel="Server limits",
        ),
    ] = None,
    slot_save_path: Annotated[
        Optional[Path],
        typer.Option(
            "--slot-save-path",
            help="A directory for POST /slots/{id}?action=save|restore|erase "
            "(llama-server's): a slot's KV cache saved to a file there and loaded back. "
            "Off without it (501).",
            rich_help_panel="Server",
        ),
    ] = None,
    reasoning_budget: Annotated[
        int,
        typer.Option(
            "--reasoning-budget",
            metavar="N",
            help="At most N tokens of thinking per answer, then the <think> block is closed "
            "(llama.cpp's flag): -1 = unlimited, 0 = no thinking. A request's "
            "reasoning_budget overrides it.",
            rich_help_panel="Server",
        ),
    ] = -1,
    engine: EngineOptions = None,
    draft: DraftOptions = None,
):
    """Serve the model over an OpenAI-compatible HTTP API.

    The endpoints are /v1/chat/completions, /v1/completions and /v1/models."""
    engine.check()
    draft.check(engine)
    if not 0 <= port <= 65535:
        raise KestrelError(f"--port must be in 0..65535, got {port}")
    if parallel < 1:
        raise KestrelError(f"--parallel must be >= 1, got {parallel}")
    if parallel > MAX_PARALLEL:  # a thread and a KV cache each: past this, --queue-size
        raise KestrelError(f"--parallel must be at most {MAX_PARALLEL}, got {parallel}")
    if queue_size < 0:
        raise KestrelError(f"--queue-size must be >= 0, got {queue_size}")
    check_reasoning_budget(reasoning_budget)
    if max_connections < 1:
        raise KestrelError(f"--max-connections must be >= 1, got {max_connections}")
    for flag, v, zero_ok in (
        ("--shutdown-timeout", shutdown_timeout, True),
        ("--timeout-header", timeout_header, False),
        ("--timeout-body", timeout_body, False),
        ("--timeout-keep-alive", timeout_keep_alive, False),
        ("--request-timeout", request_timeout, True),
    ):
        if not (v >= 0 if zero_ok else v > 0) or v == float("inf"):
            raise KestrelError(
                f"{flag} must be a number of seconds {'>=' if zero_ok else '>'} 0, got {v}"
            )
    if slot_save_path is not None:
        slot_save_path = Path(slot_save_path).expanduser()
        slot_save_path.mkdir(parents=True, exist_ok=True)  # as llama-server does
    from kestrel_cli import server  # fails with a clear message without fastapi

    server.check_api_key(api_key)  # before the model is loaded
    limits = server.Limits(
        header_timeout=timeout_header,
        body_timeout=timeout_body,
        keep_alive=timeout_keep_alive,
        request_timeout=request_timeout,
        max_connections=max_connections,
        shutdown_timeout=shutdown_timeout,
        memory_budget=memory_budget and server.parse_size(memory_budget, "--memory-budget"),
        max_request_memory=max_request_memory
        and server.parse_size(max_request_memory, "--max-request-memory"),
    )
    # the slots' sequences run in one batch thread (inference/batch.py) on -t threads
    eng = engine_from_options(engine, slots=parallel)
    draft.attach(eng, engine)  # before the forks: each slot gets its own draft cache
    server.serve(
        [eng] + [eng.fork() for _ in range(parallel - 1)],
        host=host,
        port=port,
        api_key=api_key,
        queue_size=queue_size,
        limits=limits,
        slot_save_path=slot_save_path,
        reasoning_budget=reasoning_budget,
    )


_human_bytes = kv_memory.human_bytes


def _human_count(n: int) -> str:
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.1f}{unit} ({n:,})"
    return str(n)


@app.command()
def cpus():
    """Show the CPUs this process may use and the default thread choice.

    The big and little cores come from sysfs; each fact is one `key: value` line."""
    from kestrel_cli.core.cpus import summary

    for line in summary():
        print(line)


@app.command()
def info(
    model: Annotated[
        Optional[Path],
        typer.Option(
            "-m",
            "--model",
            help="Checkpoint directory or .gguf file.",
            show_default="bundled SmolLM2-135M-Instruct",
        ),
    ] = None,
):
    """Summarise a model: architecture, size, dtypes, context, template and special tokens.

    The last line names the kernels' instruction-set variant on this CPU."""
    from kestrel_cli.models import resolve
    from kestrel_cli.models.loader import open_checkpoint

    cfg, store, tok, path = open_checkpoint(model)
    # what `run` checks at load: every tensor the model reads, present, of its shape and type
    # (the weights are memory-mapped views: nothing is computed or copied but the norms)
    resolve(cfg.model_type).Model(cfg, store, 1)
    n_params = 0
    for _fmt, _raw, shape, _src in store.entries.values():
        n = 1
        for s in shape:
            n *= int(s)
        n_params += n
    dtypes = sorted(store.dtypes().items(), key=lambda kv: -kv[1])
    rows = [
        ("path", str(path)),
        ("architecture", cfg.model_type),
        ("parameters", _human_count(n_params)),
        ("layers", cfg.num_hidden_layers),
        ("hidden size", cfg.hidden_size),
        (
            "attention",
            f"{cfg.num_attention_heads} heads, {cfg.num_key_value_heads} kv heads, "
            f"head dim {cfg.head_dim}",
        ),
    ]
    if cfg.num_experts:
        rows.append(("experts", f"{cfg.num_experts}, {cfg.num_experts_per_tok} per token"))
    rows += [
        ("vocab size", cfg.vocab_size),
        ("context length", cfg.max_position_embeddings),
        ("rope theta", cfg.rope["rope_theta"]),
        ("dtypes", ", ".join(f"{f} x{n}" for f, n in dtypes)),
        ("weights memory", _human_bytes(store.nbytes)),
        (
            "chat template",
            "no (use --raw)"
            if not tok.chat_template
            else "yes"
            if (bad := tok.chat_template_error()) is None
            else "present, but it does not compile: " + bad.removeprefix("invalid chat template: "),
        ),
    ]

    def special(name):
        t = getattr(tok, f"{name}_token")
        return None if t is None else f"{name}={t!r} ({getattr(tok, f'{name}_token_id')})"

    toks = [s for s in map(special, ("bos", "eos", "pad", "unk")) if s]
    toks.append(f"stop ids={sorted(tok.eos_token_ids)}")
    rows.append(("special tokens", ", ".join(toks)))
    from kestrel_cli.runtime.kernels import isa, isa_variants

    rows.append(
        ("kernels", f"{isa()} (this CPU runs {', '.join(isa_variants())}; KESTREL_ISA picks one)")
    )
    width = max(len(k) for k, _ in rows) + 1
    for k, v in rows:
        print(f"{k + ':':<{width}} {v}")


PPL_WINDOW = 4096  # ppl's window without -c: its logits (window x vocab float32) are kept


@app.command()
@with_options
def ppl(
    file: Annotated[
        Path,
        typer.Option(
            "-f",
            "--file",
            help=f"UTF-8 text to score ('-' reads stdin), at most {PPL_BYTES // MiB} MiB.",
            rich_help_panel=_PROMPT,
        ),
    ],
    kld_ref: Annotated[
        bool,
        typer.Option(
            "--kld-ref",
            help="Also print the mean KL divergence of the next-token "
            "distributions from the exact path's (float32 exact attention and activations) "
            "over the same windows; each window runs twice.",
            rich_help_panel=_OUTPUT,
        ),
    ] = False,
    llama_cpp: Annotated[
        bool,
        typer.Option(
            "--llama-cpp",
            help="Score as llama.cpp's llama-perplexity does (whole windows, "
            "BOS first when the model adds one, the second half of each window scored), to "
            "compare the two engines on one file and text.",
            rich_help_panel=_OUTPUT,
        ),
    ] = False,
    engine: EngineOptions = None,
):
    """Measure the perplexity of a text, in windows of the context size (-c; without it the
    model's context, at most PPL_WINDOW tokens: a window's logits are all kept).

    The attention and activation settings are this run's flags.
    It prints one line of key=value pairs: tokens, windows, ppl (and kld) and the time."""
    from kestrel_cli.apps.ppl import perplexity

    engine.check()
    text = read_prompt(None, file, cap=PPL_BYTES, what="text")
    eng = engine_from_options(engine)
    ids = eng.tokenizer.encode(text, add_special_tokens=True)
    window = eng.ctx_size if engine.ctx_size is not None else min(eng.ctx_size, PPL_WINDOW)
    # a window's KV cache (twice with --kld-ref) must fit the memory available now
    kv_memory.check_request(eng, min(window, len(ids)) * (2 if kld_ref else 1), "a smaller -c")
    res = perplexity(eng, ids, window, kld_ref=kld_ref, llama_cpp=llama_cpp)
    print(res.line())


@app.command()
@with_options
def bench(
    n_prompt: Annotated[
        int,
        typer.Option(
            "-p",
            "--n-prompt",
            help="Prompt tokens per pp test; 0 = no pp test.",
            rich_help_panel=_PROMPT,
        ),
    ] = 512,
    n_gen: Annotated[
        int,
        typer.Option(
            "-n", "--n-gen", help="Tokens per tg test; 0 = no tg test.", rich_help_panel=_PROMPT
        ),
    ] = 128,
    depth: Annotated[
        str,
        typer.Option(
            "-d",
            "--depth",
            help="Comma-separated context depths: tokens already in the KV cache before each test.",
            rich_help_panel=_PROMPT,
        ),
    ] = "0",
    repetitions: Annotated[
        int,
        typer.Option(
            "-r", "--repetitions", help="Runs per test (mean ± sd).", rich_help_panel=_OUTPUT
        ),
    ] = 5,
    output: Annotated[
        str,
        typer.Option("-o", "--output", help="Print md (a table) or json.", rich_help_panel=_OUTPUT),
    ] = "md",
    engine: EngineOptions = None,
):
    """Measure prompt processing (pp) and generation (tg) speed, as llama-bench does.

    Each test runs at each depth; the tokens/s go to stdout as a table, then the peak RSS."""
    from kestrel_cli.apps.bench import render, run_bench

    engine.check()
    try:
        depths = [int(d) for d in depth.split(",") if d.strip()]
    except ValueError:
        raise KestrelError(f"-d/--depth: expected comma-separated integers, got {depth!r}")
    if output not in ("md", "json"):
        raise KestrelError(f"-o/--output must be md or json, got {output!r}")
    # bench fills a cache of its own: the deepest test's tokens, bounded as -c is
    need = max(depths or [0]) + max(n_prompt, n_gen) + 1
    if need > MAX_CTX:
        raise KestrelError(
            f"bench: -d + max(-p, -n) must be at most {MAX_CTX} tokens, got {need - 1}"
        )
    eng = engine_from_options(engine)
    if min(depths or [0]) >= 0 and min(n_prompt, n_gen) >= 0:  # else run_bench says so
        kv_memory.check_request(eng, need, "smaller -d, -p or -n")
    report = run_bench(
        eng,
        n_prompt,
        n_gen,
        depths or [0],
        repetitions,
        quant=Quant(engine.quant).value,
        progress=lambda s: print(f"bench: {s}", file=sys.stderr, flush=True),
    )
    print(render(report) if output == "md" else report.to_json())


@app.command()
def quantize(
    src: Annotated[
        Path,
        typer.Argument(
            metavar="IN",
            help="Hugging Face checkpoint directory (config.json, *.safetensors, tokenizer.json).",
            show_default=False,
        ),
    ],
    out: Annotated[
        Path, typer.Argument(metavar="OUT", help="GGUF file to write.", show_default=False)
    ],
    type_: Annotated[
        GGUFType,
        typer.Option(
            "--type",
            help="GGUF file type, with the tensor mix llama-quantize picks for it "
            "(q4_k_m/q5_k_m: Q6_K on attn_v and ffn_down of some layers; output Q6_K "
            "except in q8_0).",
            show_default=False,
        ),
    ],
    pure: Annotated[
        bool,
        typer.Option(
            "--pure",
            help="Quantise every matrix to the type itself, output and token "
            "embeddings included (llama-quantize --pure).",
        ),
    ] = False,
    threads: Annotated[
        Optional[int],
        typer.Option(
            "-t",
            "--threads",
            help=f"Threads that quantise: at most {THREADS_PER_CORE} per core, "
            f"{THREADS_FLOOR} allowed on any machine, never more than {THREADS_MAX}.",
            show_default="all available cores",
        ),
    ] = None,
    mmproj: Annotated[
        Optional[Path],
        typer.Option(
            "--mmproj",
            metavar="FILE",
            help="Also write a Qwen3-VL checkpoint's vision tower to FILE, as llama.cpp's "
            "mmproj GGUF (convert_hf_to_gguf.py --mmproj); run them with -m OUT --mmproj FILE.",
            show_default=False,
        ),
    ] = None,
    mmproj_type: Annotated[
        MmprojType,
        typer.Option("--mmproj-type", help="Type of the --mmproj file's matrices."),
    ] = MmprojType.f16,
):
    """Write a checkpoint as a GGUF file, in llama.cpp's layout.

    The tensors are written one by one, in bounded memory.
    OUT appears only once it is complete (it is OUT.part while being written)."""
    from kestrel_cli.apps.gguf_export import Terminated, quantize_checkpoint
    from kestrel_cli.apps.mmproj_export import check_source, write_mmproj

    LoadOptions(threads=threads).validate()  # -t within what this machine can start
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    if mmproj is not None:  # refused before OUT is written
        if Path(mmproj).expanduser().resolve() == out.expanduser().resolve():
            raise KestrelError("--mmproj and OUT name the same file")
        check_source(src, mmproj, MmprojType(mmproj_type).value)
    writing = out
    try:
        quantize_checkpoint(
            src,
            out,
            GGUFType(type_).value,
            pure=pure,
            progress=sys.stderr.isatty(),
            log=log,
            threads=threads,
        )
        if mmproj is not None:
            writing = mmproj
            write_mmproj(src, mmproj, MmprojType(mmproj_type).value, log=log, threads=threads)
    except KeyboardInterrupt:
        print(f"interrupted: {writing} not written", file=sys.stderr)
        raise typer.Exit(130)
    except Terminated as e:  # the status a process ended by SIGTERM would have
        print(f"error: {e}", file=sys.stderr)
        raise typer.Exit(143)


def main() -> None:
    """Console entry point `kestrel`."""
    try:
        app(prog_name="kestrel")
    except KeyboardInterrupt:  # outside a command (e.g. while importing)
        print("error: interrupted", file=sys.stderr)
        sys.exit(130)


if __name__ == "__main__":
    main()
