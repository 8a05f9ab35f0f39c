"""`kestrel run / info / chat` through typer's CliRunner, on the bundled SmolLM2 (greedy)."""

from __future__ import annotations

import dataclasses
import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kestrel_cli import cli
from kestrel_cli.cli import (
    EngineOptions,
    OutputOptions,
    SamplingOptions,
    app,
    engine_from_options,
    with_options,
)
from kestrel_cli.inference.generate import Stats, TokenTiming
from kestrel_cli.inference.timing import (
    DEC_KEYS,
    PERF_KEYS,
    TimingPrinter,
    format_dec,
    format_perf,
    parse_line,
    parse_lines,
)
from kestrel_cli.runtime.kv_cache import CacheSpec
from kestrel_cli.runtime.sparse import SparseSpec

QUESTION = "What is the capital of France?"
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def parse_model_once():
    """Parse the bundled GGUF once per module (the gguf reader takes seconds); each command
    still builds its Engine through Engine.from_pretrained with all its checks."""
    import kestrel_cli.inference.engine as engine_mod
    import kestrel_cli.models.loader as loader_mod

    real, memo = loader_mod.open_checkpoint, {}

    def once(path, mmproj=None):
        if path is not None or mmproj is not None:
            return real(path, mmproj)
        if "bundled" not in memo:
            memo["bundled"] = real(None)
        return memo["bundled"]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_mod, "open_checkpoint", once)
        mp.setattr(loader_mod, "open_checkpoint", once)
        yield


def invoke(*args, input=None):
    """Run `kestrel ARGS`; one thread unless -t is given (OpenMP threads that spin-wait
    slow down many times over when other processes share the 2 cores)."""
    args = [str(a) for a in args]
    if args[:1] in (["run"], ["chat"]) and "-t" not in args:
        args += ["-t", "1"]
    return CliRunner().invoke(app, args, input=input)


def ok(result):
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    return result


# ------------------------------------------------------------------------- run


def test_run_streams_greedy_answer_and_timing():
    # --act f32: the greedy answer is a near tie ("The" 0.15 vs "L" 0.14) that int8
    # activations flip, as in llama.cpp; this test is about streaming and the timing lines.
    r = ok(invoke("run", "-p", QUESTION, "--temp", "0", "-n", "16", "--act", "f32"))
    assert r.stdout == "The capital of France is Paris.\n"
    decs = parse_lines(r.stderr, "DEC-SINGLE")
    (perf,) = parse_lines(r.stderr, "PERF")
    assert list(perf) == list(PERF_KEYS)
    assert decs and all(list(d) == list(DEC_KEYS) for d in decs)
    # one line per decoded token, positions right after the prompt
    assert perf["decode_tokens"] == len(decs)
    assert [d["tok"] for d in decs] == list(range(len(decs)))
    assert [d["pos"] for d in decs] == list(
        range(perf["prefill_tokens"], perf["prefill_tokens"] + len(decs))
    )
    for d in decs:
        assert d["ms"] > 0 and d["attn"] >= 0 and d["matmul"] > 0 and d["other"] >= 0
        assert abs(d["ms"] - d["attn"] - d["matmul"] - d["other"]) <= 0.2
    # attn and matmul are measured: they add up to most of the token, matmul dominating
    assert sum(d["attn"] for d in decs) > 0
    assert sum(d["matmul"] for d in decs) > sum(d["attn"] for d in decs)
    assert perf["attn_ms_per_tok"] == pytest.approx(
        sum(d["attn"] for d in decs) / len(decs), abs=0.1
    )
    assert perf["prefill_tps"] > 0 and perf["decode_tps"] > 0 and perf["kv_bytes"] > 0
    # exact text of the lines: one decimal on every time
    for line in r.stderr.splitlines():
        if line.startswith("[DEC-SINGLE]"):
            assert re.fullmatch(
                r"\[DEC-SINGLE\] tok=\d+ pos=\d+ ms=\d+\.\d attn=\d+\.\d "
                r"matmul=\d+\.\d other=\d+\.\d",
                line,
            ), line


def test_run_no_timing_prompt_file_stdin_system_raw(tmp_path):
    f = tmp_path / "q.txt"
    f.write_text(QUESTION + "\n")
    # --act f32: the greedy answer is a near tie ("The" 0.15 vs "L" 0.14) that int8
    # activations flip, as in llama.cpp; this test is about -f, stdin, -s and --raw.
    a = ok(invoke("run", "-f", f, "--temp", "0", "-n", "12", "--no-timing", "--act", "f32"))
    assert a.stdout == "The capital of France is Paris.\n" and a.stderr == ""
    b = ok(
        invoke(
            "run",
            "-p",
            "-",
            "--temp",
            "0",
            "-n",
            "12",
            "--no-timing",
            "--act",
            "f32",
            input=QUESTION,
        )
    )
    assert b.stdout == a.stdout
    c = ok(
        invoke(
            "run",
            "-p",
            QUESTION,
            "-s",
            "Answer in French.",
            "--temp",
            "0",
            "-n",
            "6",
            "--no-timing",
            "--act",
            "f32",
        )
    )
    assert c.stdout != a.stdout and c.stdout.endswith("\n")
    d = ok(
        invoke(
            "run",
            "--raw",
            "-p",
            "The capital of France is",
            "--temp",
            "0",
            "-n",
            "3",
            "--no-timing",
        )
    )
    assert "Paris" in d.stdout


def test_run_sampling_flags_seeded_and_ignore_eos():
    args = (
        "run",
        "-p",
        QUESTION,
        "-n",
        "8",
        "--temp",
        "0.9",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--min-p",
        "0.02",
        "--repeat-penalty",
        "1.1",
        "--seed",
        "7",
        "--no-timing",
    )
    assert ok(invoke(*args)).stdout == ok(invoke(*args)).stdout
    # -n -1 with --ignore-eos runs until the context is full (no crash, exit 0)
    r = ok(invoke("run", "-p", QUESTION, "--temp", "0", "-n", "-1", "--ignore-eos", "-c", "48"))
    decs = parse_lines(r.stderr, "DEC-SINGLE")
    assert decs[-1]["pos"] == 47


def test_default_context_is_the_model_s():
    eng = engine_from_options(EngineOptions(threads=1))
    assert eng.config.max_position_embeddings == 8192 and eng.ctx_size == 8192
    assert engine_from_options(EngineOptions(ctx_size=100, threads=1)).ctx_size == 100
    # a model of a shorter context keeps its own
    import kestrel_cli.inference.engine as engine_mod

    real = engine_mod.open_checkpoint

    def short(path, mmproj=None):
        cfg, *rest = real(path, mmproj)
        return (dataclasses.replace(cfg, max_position_embeddings=1000), *rest)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(engine_mod, "open_checkpoint", short)
        eng = engine_from_options(EngineOptions(threads=1))
    assert eng.ctx_size == 1000 and eng.cache.max_tokens == 1000


# ------------------------------------------------------------------------- bad input

LONG = "word " * 200


def test_engine_and_cli_share_one_validation():
    """The library and the flags fail on the same values with the same message, before
    any file is read; the context cap is an Engine option."""
    from kestrel_cli.core.errors import KestrelError
    from kestrel_cli.inference.engine import Engine, LoadOptions, default_threads

    for kw, needle in (
        (dict(threads=0), "-t/--threads must be >= 1, got 0"),
        (dict(ctx_size=0), "-c/--ctx-size must be >= 1, got 0"),
        (dict(sparse_k=0), "--sparse-k must be >= 1, got 0"),
        (dict(sparse_probes=0), "--sparse-probes must be >= 1, got 0"),
    ):
        with pytest.raises(KestrelError, match=re.escape(needle)):
            Engine.from_pretrained("/no/such/model_dir", **kw)
        with pytest.raises(KestrelError, match=re.escape(needle)):
            EngineOptions(**kw).check()
    with pytest.raises(KestrelError, match="--quant must be one of none"):
        Engine.from_pretrained("/no/such/model_dir", quant="q3")
    # -c wins; without it the model's context length, at most the cap
    assert LoadOptions(ctx_size=100, ctx_cap=50).context(8192) == 100
    assert LoadOptions(ctx_cap=4096).context(8192) == 4096
    assert LoadOptions(ctx_cap=4096).context(1000) == 1000
    assert LoadOptions().context(8192) == 8192
    assert EngineOptions().load_options().ctx_cap is None  # no cap: the model's context
    eng = Engine.from_pretrained(None, threads=1, ctx_cap=300)
    assert eng.ctx_size == 300 and eng.cache.max_tokens == 300 and eng.threads == 1
    assert default_threads() >= 1


@pytest.fixture
def not_a_file(tmp_path):
    d = tmp_path / "a_directory"
    d.mkdir()
    return d


@pytest.mark.parametrize(
    "args, needle",
    [
        (["run", "--bogus"], "No such option: --bogus"),
        (["run", "-p", "x", "-n", "-5"], "-n/--n-predict must be >= -1"),
        (["run", "-p", "x", "-n", "lots"], "--n-predict"),
        (["run", "-p", "x", "-m", "/no/such/model_dir"], "does not exist"),
        (["run", "-f", "/no/such/prompt.txt"], "cannot read prompt file"),
        (["run", "-f", "NOT_A_FILE"], "cannot read prompt file"),
        (["run", "-p", "x", "--sparse-k", "0"], "--sparse-k must be >= 1"),
        (["run", "-p", "x", "--sparse-probes", "0"], "--sparse-probes must be >= 1"),
        (["run", "-p", LONG, "-c", "32", "--temp", "0"], "more than the context size 32"),
        (["run", "-p", "x", "--quant", "q5"], "'q5' is not one of"),
        (["run"], "no prompt"),
        (["run", "-p", "   "], "empty prompt"),
        (["run", "-p", "x", "-f", "y"], "not both"),
        (["run", "-p", "x", "--raw", "-s", "sys"], "--raw"),
        (["run", "-p", "x", "--temp", "-1"], "temperature must be >= 0"),
        (["run", "-p", "x", "--top-p", "0"], "top_p must be in (0, 1]"),
        (["run", "-p", "x", "-t", "0"], "-t/--threads must be >= 1"),
        (["run", "-p", "x", "-c", "0"], "-c/--ctx-size must be >= 1"),
        (["chat", "--sparse-k", "0"], "--sparse-k must be >= 1"),
        (["info", "-m", "/no/such/model_dir"], "does not exist"),
        (["nope"], "No such command"),
    ],
)
def test_bad_input_is_one_line_no_traceback(args, needle, not_a_file):
    args = [str(not_a_file) if a == "NOT_A_FILE" else a for a in args]
    r = invoke(*args)
    assert r.exit_code != 0
    assert isinstance(r.exception, SystemExit), r.exception  # no uncaught exception
    assert "Traceback" not in r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    assert needle in lines[0]
    assert r.stdout == ""


def test_path_flags_take_effect(tmp_path):
    """--kv-q8, --quant and --sparse-attn change what runs; none is parsed and ignored."""

    def perf(*flags):
        r = ok(invoke("run", "-p", QUESTION, "--temp", "0", "-n", "4", "-t", "1", *flags))
        (p,) = parse_lines(r.stderr, "PERF")
        return r.stdout, p

    base_out, base = perf()
    q8_out, q8 = perf("--kv-q8")
    assert q8["kv_bytes"] < 0.3 * base["kv_bytes"]
    from conftest import make_checkpoint

    make_checkpoint(tmp_path, "qwen3")  # f32 weights: --quant converts them
    opts = cli.EngineOptions(
        model=tmp_path,
        threads=1,
        quant=cli.Quant("q8"),
        kv_q8=True,
        sparse_attn=True,
        sparse_k=4,
        sparse_probes=2,
    )
    eng = cli.engine_from_options(opts, spinner=False)
    assert eng.model.layers[0].mlp.gate_proj.fmt == "q8_0x16"  # quantised, then repacked
    assert eng.spec == CacheSpec("q8", sparse=SparseSpec(k=4, probes=2)) == eng.cache.spec
    sparse_out, _ = perf("--sparse-attn", "--sparse-k", "1")
    assert base_out.strip() and sparse_out.strip()


def test_exit_codes_of_the_real_command():
    """The console entry point (not CliRunner): one line, status 2 for usage, 1 for input."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for args, code, needle in (
        (["run", "--bogus"], 2, "No such option"),
        (["run", "-p", "x", "-m", "/no/such/dir"], 1, "does not exist"),
        (["run", "-p", "x", "-n", "-5"], 1, "--n-predict"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "kestrel_cli.cli", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == code and r.stdout == ""
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and needle in r.stderr
    r = subprocess.run(
        [sys.executable, "-m", "kestrel_cli.cli"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "run" in r.stdout and "chat" in r.stdout and "info" in r.stdout


def test_spinner_while_a_big_model_loads(monkeypatch):
    err = _Tty()
    monkeypatch.setattr(cli, "SPINNER_BYTES", 0)
    monkeypatch.setattr(sys, "stderr", err)
    eng = engine_from_options(EngineOptions(threads=1, ctx_size=64))
    assert eng.ctx_size == 64
    assert "loading bundled model" in ANSI.sub("", err.getvalue())


# ------------------------------------------------------------------------- help, info


def test_help_shows_every_flag_with_default():
    r = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200", "TERMINAL_WIDTH": "200"})
    ok(r)
    text = ANSI.sub("", r.stdout)
    for flag in (
        "--prompt",
        "-p",
        "--file",
        "-f",
        "--system",
        "-s",
        "--raw",
        "--model",
        "-m",
        "--n-predict",
        "-n",
        "--ctx-size",
        "-c",
        "--threads",
        "-t",
        "--temp",
        "--top-k",
        "--top-p",
        "--min-p",
        "--repeat-penalty",
        "--seed",
        "--ignore-eos",
        "--sparse-attn",
        "--sparse-k",
        "--sparse-probes",
        "--kv-q8",
        "--quant",
        "--timing",
        "--no-timing",
    ):
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text), flag
    for default in (
        "256",
        "0.8",
        "40",
        "0.95",
        "0.05",
        "1.0",
        "32",
        "8",
        "none",
        "timing",
        "(random)",
        "(bundled SmolLM2-135M-Instruct)",
        "(all available cores)",
        "(the model's)",
    ):
        assert f"[default: {default}]" in text, default
    chat_help = ANSI.sub(
        "", ok(CliRunner().invoke(app, ["chat", "--help"], env={"COLUMNS": "200"})).stdout
    )
    for flag in (
        "--system",
        "--model",
        "--ctx-size",
        "--temp",
        "--seed",
        "--sparse-attn",
        "--kv-q8",
        "--quant",
        "--timing",
    ):
        assert flag in chat_help


def test_info():
    r = ok(invoke("info"))
    fields = dict(line.split(":", 1) for line in r.stdout.splitlines())
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    assert fields["architecture"] == "llama"
    assert fields["parameters"].startswith("134.5M")
    assert fields["context length"] == "8192"
    assert "q4_1" in fields["dtypes"] and "f32" in fields["dtypes"]
    assert fields["weights memory"].endswith("MiB")
    assert fields["chat template"] == "yes"
    assert "eos='<|im_end|>'" in fields["special tokens"]
    from kestrel_cli.runtime import kernels

    assert fields["kernels"].startswith(
        f"{kernels.isa()} (this CPU runs {', '.join(kernels.isa_variants())};"
    )


# ------------------------------------------------------------------------- shared options


def test_with_options_lets_other_commands_reuse_the_flags():
    seen = {}
    other = typer.Typer()

    @other.command()
    @with_options
    def bench(
        n: int = 3,
        engine: EngineOptions = None,
        sampling: SamplingOptions = None,
        output: OutputOptions = None,
    ):
        seen.update(n=n, engine=engine, sampling=sampling, output=output)

    @other.command()
    def unused():
        pass

    r = CliRunner().invoke(
        other,
        [
            "bench",
            "--n",
            "5",
            "-m",
            "/x",
            "--sparse-k",
            "4",
            "--quant",
            "q8",
            "-c",
            "64",
            "--temp",
            "0",
            "--no-timing",
        ],
    )
    assert r.exit_code == 0, r.output
    assert seen["n"] == 5
    assert seen["engine"] == EngineOptions(
        model=Path("/x"), sparse_k=4, quant=cli.Quant.q8, ctx_size=64
    )
    assert seen["sampling"].temp == 0 and seen["sampling"].n_predict == 256
    assert seen["output"].timing is False


# ------------------------------------------------------------------------- timing lines


def test_timing_format_and_parse_roundtrip():
    line = format_dec(TokenTiming(12, 2073, 56.24, 12.81, 40.06))
    assert line == "[DEC-SINGLE] tok=12 pos=2073 ms=56.2 attn=12.8 matmul=40.1 other=3.4"
    assert parse_line(line) == (
        "DEC-SINGLE",
        dict(tok=12, pos=2073, ms=56.2, attn=12.8, matmul=40.1, other=3.4),
    )
    s = Stats(
        prompt_tokens=2061,
        prefill_tokens=2061,
        prefill_ms=1000.0,
        decode_tokens=10,
        decode_ms=500.0,
        attn_ms=20.0,
        kv_bytes=4096,
    )
    perf = format_perf(s)
    assert perf == (
        "[PERF] prefill_tokens=2061 prefill_ms=1000.0 prefill_tps=2061.0 "
        "decode_tokens=10 decode_ms=500.0 decode_tps=20.0 attn_ms_per_tok=2.0 "
        "kv_bytes=4096"
    )
    tag, kv = parse_line(perf)
    assert tag == "PERF" and list(kv) == list(PERF_KEYS)
    assert parse_line("The capital of France is Paris.") is None
    assert parse_line("[PERF] broken") is None


class _Tty(io.StringIO):
    def isatty(self):
        return True


def test_timing_printer_plain_rich_deferred_off():
    t = TokenTiming(0, 5, 3.0, 1.0, 1.5)
    plain = io.StringIO()
    p = TimingPrinter(True, stream=plain, out=io.StringIO())
    p.token(t)  # not a terminal: written at once
    assert plain.getvalue() == format_dec(t) + "\n"

    err, out = _Tty(), _Tty()  # stdout and stderr on one terminal
    p = TimingPrinter(True, stream=err, out=out)
    p.token(t)
    assert err.getvalue() == ""  # held until the reply ends
    p.perf(Stats(decode_tokens=1, decode_ms=3.0))
    lines = [ANSI.sub("", x) for x in err.getvalue().splitlines()]
    assert lines[0] == format_dec(t) and lines[1].startswith("[PERF] ")

    off = io.StringIO()
    p = TimingPrinter(False, stream=off, out=io.StringIO())
    p.token(t)
    p.perf(Stats())
    assert off.getvalue() == ""


def test_act_flag_reaches_the_model(monkeypatch):
    """--act q8, the default, loads the model with int8 activations (and --act f32 not);
    a bad value is one usage error."""
    from kestrel_cli import cli

    seen = []
    real = cli.engine_from_options

    def spy(opts, *a, **kw):
        eng = real(opts, *a, **kw)
        seen.append(eng.model.act)
        return eng

    monkeypatch.setattr(cli, "engine_from_options", spy)
    for flag, want in (([], "q8"), (["--act", "f32"], "f32"), (["--act", "q8"], "q8")):
        r = invoke("run", "-p", "Hi", "-n", "2", "--temp", "0", "--no-timing", *flag)
        assert r.exit_code == 0, (r.output, r.exception)
        assert seen[-1] == want
    r = invoke("run", "-p", "Hi", "--act", "int4")
    assert r.exit_code == 2 and "--act" in r.output and "Traceback" not in r.output


# ------------------------------------------------------------------------- readable output


def test_timing_printer_holds_lines_to_the_answer_s_line_boundaries():
    """One stream for both (shared): a [DEC-SINGLE] line waits for the answer's newline."""
    both = io.StringIO()
    p = TimingPrinter(True, stream=both, out=both, shared=True)
    t = [TokenTiming(i, 10 + i, 3.0, 1.0, 1.5) for i in range(4)]
    p.token(t[0])  # nothing written yet: at a line start, at once
    p.text("The capital")
    p.token(t[1])
    p.text(" is Paris.\nIt is")  # held line goes out after the newline
    p.token(t[2])
    p.text(" big.")
    p.token(t[3])
    p.text("\n")
    p.perf(Stats(decode_tokens=4, decode_ms=12.0))
    lines = both.getvalue().splitlines()
    assert lines == [
        format_dec(t[0]),
        "The capital is Paris.",
        format_dec(t[1]),
        "It is big.",
        format_dec(t[2]),
        format_dec(t[3]),
        format_perf(Stats(decode_tokens=4, decode_ms=12.0)),
    ]


def test_combined_stdout_and_stderr_keep_the_answer_s_lines_whole():
    """`kestrel run ... 2>&1 | tee`: one pipe for both streams; the timing lines sit between
    the answer's lines, one per decoded token, and the answer is the same text as alone."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_WAIT_POLICY="passive")
    args = [
        sys.executable,
        "-m",
        "kestrel_cli.cli",
        "run",
        "-p",
        "List five fruits, one per line.",
        "-n",
        "24",
        "--temp",
        "0",
        "-t",
        "1",
    ]
    both = subprocess.run(
        args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300
    )
    assert both.returncode == 0, both.stdout
    alone = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert alone.returncode == 0, alone.stderr
    answer, timing = [], []
    for line in both.stdout.splitlines():
        parsed = parse_line(line)
        (timing if parsed else answer).append(line)
        assert parsed or "[DEC-SINGLE]" not in line and "[PERF]" not in line, line
    assert "\n".join(answer) + "\n" == alone.stdout
    assert alone.stdout.count("\n") >= 3  # a multi-line answer: it was tested
    decs = parse_lines(both.stdout, "DEC-SINGLE")
    perf = parse_lines(both.stdout, "PERF")
    assert len(perf) == 1 and len(decs) == perf[0]["decode_tokens"] > 10
    assert [d["tok"] for d in decs] == list(range(len(decs)))
    assert timing[-1].startswith("[PERF]")


def test_run_json_schema(tmp_path):
    """--json-schema: the answer parses and matches (bundled model, sampled, 2 seeds)."""
    import json

    schema = {
        "type": "object",
        "properties": {"fruit": {"type": "string", "maxLength": 16}, "count": {"type": "integer"}},
        "required": ["fruit", "count"],
        "additionalProperties": False,
    }
    f = tmp_path / "s.json"
    f.write_text(json.dumps(schema))
    for seed in ("1", "2"):
        r = ok(
            invoke(
                "run",
                "-p",
                "Name a fruit and a number.",
                "--json-schema",
                f,
                "-n",
                "80",
                "--seed",
                seed,
                "--no-timing",
            )
        )
        obj = json.loads(r.stdout)
        assert set(obj) == {"fruit", "count"} and isinstance(obj["count"], int)
    f.write_text("[1]")
    r = invoke("run", "-p", "x", "--json-schema", f)
    assert r.exit_code == 1 and "JSON object" in r.output
