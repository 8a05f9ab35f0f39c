"""Hostile input to the real `kestrel` command: endless or huge files and stdin, thread and
slot counts no machine can start, contexts no memory holds. Each is refused with one
`error: ...` line and exit status 1, never a traceback, a hang or a huge allocation.

Every command runs as a subprocess under an address-space limit (RLIMIT_AS) and a timeout,
so that a regression fails the test instead of eating the machine: an unbounded read of
/dev/zero ends as "out of memory", 100000 threads fail to start, a hang times out.
"""

from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from kestrel_cli import cli
from kestrel_cli.inference.engine import thread_cap

ROOT = Path(__file__).resolve().parents[1]
GiB = 1 << 30


def kestrel(*args, stdin=subprocess.DEVNULL, input=None, mem=2 * GiB, timeout=180):
    """`python -m kestrel_cli.cli ARGS` with at most `mem` bytes of address space (the
    bundled model runs in about 1.5 GiB); stdin from a file object or the bytes `input`."""

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (mem, mem))

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "kestrel_cli.cli", *map(str, args)],
        stdin=None if input is not None else stdin,
        input=input,
        capture_output=True,
        env=env,
        timeout=timeout,
        preexec_fn=limit,
    )


def refused(r, needle: str) -> str:
    """Exit status 1, nothing on stdout, one `error: ...` line on stderr holding `needle`."""
    err = r.stderr.decode("utf-8", "replace")
    assert b"Traceback" not in r.stderr, err
    lines = err.strip().splitlines()
    assert r.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), (
        r.returncode,
        err[-2000:],
    )
    assert needle in lines[0], lines[0]
    assert r.stdout == b""
    return lines[0]


# ------------------------------------------------------------------ files and stdin


@pytest.mark.parametrize("args", [["run", "-p", "-"], ["run", "-f", "-"]])
def test_endless_prompt_on_stdin(args):
    with open("/dev/zero", "rb") as zero:
        refused(kestrel(*args, "-t", "1", stdin=zero), "the prompt on stdin is larger than 32 MiB")


def test_endless_and_huge_prompt_files(tmp_path):
    refused(
        kestrel("run", "-t", "1", "-f", "/dev/zero"), "prompt file /dev/zero is larger than 32 MiB"
    )
    big = tmp_path / "big.txt"
    with open(big, "wb") as f:  # sparse: 33 MiB that take no disk
        f.truncate(33 << 20)
    refused(kestrel("run", "-t", "1", "-f", big), "is larger than 32 MiB")


def test_endless_json_schema():
    refused(
        kestrel("run", "-t", "1", "-p", "hi", "--json-schema", "/dev/zero"),
        "--json-schema /dev/zero is larger than 1 MiB",
    )


def test_json_schema_nested_past_python_s_recursion_limit(tmp_path):
    f = tmp_path / "deep.json"
    f.write_text("[" * 100_000 + "]" * 100_000)
    refused(
        kestrel("run", "-t", "1", "-p", "hi", "--json-schema", f),
        f"--json-schema {f} is not JSON: nested too deeply",
    )


def test_ppl_text_is_bounded():
    refused(
        kestrel("ppl", "-t", "1", "-f", "/dev/zero"), "text file /dev/zero is larger than 16 MiB"
    )
    with open("/dev/zero", "rb") as zero:
        refused(
            kestrel("ppl", "-t", "1", "-f", "-", stdin=zero),
            "the text on stdin is larger than 16 MiB",
        )


def test_prompt_longer_than_the_context_is_refused_before_tokenising(tmp_path):
    """Under the byte cap but more characters than 8192 tokens can hold: refused from its
    length (Tokenizer.max_text_chars), not after tokenising it."""
    f = tmp_path / "long.txt"
    f.write_text("hello " * 600_000)  # 3.6 MB, ~600K tokens
    line = refused(kestrel("run", "-t", "1", "-f", f), "characters, more than a context of")
    assert "8192 tokens" in line and "-c/--ctx-size" in line


def test_chat_endless_line_on_stdin():
    """/dev/zero has no newline: one chat line never ends."""
    with open("/dev/zero", "rb") as zero:
        r = kestrel("chat", "-t", "1", stdin=zero)
    err = r.stderr.decode("utf-8", "replace")
    assert b"Traceback" not in r.stderr, err
    assert r.returncode == 1  # stdout has the banner and the "> " prompt
    assert err.strip().splitlines() == ["error: a chat line on stdin is larger than 32 MiB"]


def test_chat_too_long_or_not_utf8_line_then_goes_on():
    """A piped line too long for the context, or not UTF-8, is an error for that line; the
    chat goes on to the next."""
    text = b"hello " * 500_000 + b"\n" + b"\xff\xfe hi\n" + b"/stats\n/exit\n"
    r = kestrel("chat", "-t", "1", input=text)
    out = r.stdout.decode()
    assert r.returncode == 0 and b"Traceback" not in r.stderr, r.stderr[-2000:]
    assert (
        "[error: the message has 2999999 characters, more than a context of 8192 tokens" in out
    ), out[-2000:]
    assert "[error: the message is not UTF-8 text (byte 0)]" in out
    assert "turns" in out.split("[error: the message is not UTF-8")[1]  # /stats ran after


# ------------------------------------------------------------------ threads and slots


@pytest.mark.parametrize(
    "args",
    [
        ["run", "-p", "hi"],
        ["chat"],
        ["ppl", "-f", "/dev/null"],
        ["bench", "-p", "8", "-n", "8", "-r", "1"],
        ["serve"],
        ["quantize", "/no/such/dir", "/tmp/x.gguf", "--type", "q8_0"],
    ],
)
def test_thread_count_is_bounded(args):
    cap = thread_cap()
    for t in ("100000", str(cap + 1)):
        refused(
            kestrel(*args, "-t", t, timeout=60),
            f"-t/--threads must be at most {cap} (4 per core, at least 64, at most 512), got {t}",
        )


def test_thread_cap_rule(monkeypatch):
    """4 per core, at least 64, at most 512 (ggml's GGML_MAX_N_THREADS)."""
    for cores, cap in (
        (1, 64),
        (2, 64),
        (16, 64),
        (17, 68),
        (100, 400),
        (128, 512),
        (1024, 512),
        (None, 64),
    ):
        monkeypatch.setattr(os, "cpu_count", lambda c=cores: c)
        assert thread_cap() == cap
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    cli.EngineOptions(threads=64).check()
    with pytest.raises(cli.KestrelError, match="at most 64"):
        cli.EngineOptions(threads=65).check()
    # the library refuses them too, before any file is read (it used to segfault in libgomp)
    from kestrel_cli.inference.engine import Engine

    for kw, needle in (
        (dict(threads=65), "-t/--threads must be at most 64"),
        (dict(ctx_size=cli.MAX_CTX + 1), "-c/--ctx-size must be at most"),
    ):
        with pytest.raises(cli.KestrelError, match=needle):
            Engine.from_pretrained("/no/such/model_dir", **kw)


def test_parallel_is_bounded():
    refused(kestrel("serve", "--parallel", "1000"), "--parallel must be at most 64, got 1000")
    refused(kestrel("serve", "--parallel", "65"), "--parallel must be at most 64, got 65")


def test_parallel_kv_caches_must_fit_the_memory():
    """64 slots of the largest context: each KV cache would hold 2^24 tokens (about 720 GiB
    for the bundled model), refused up front with the memory they need."""
    line = refused(
        kestrel("serve", "--parallel", "64", "-c", str(cli.MAX_CTX), "-t", "1", mem=6 * GiB),
        "64 KV caches of 16777216 tokens need",
    )
    assert "more than this machine's" in line and "--kv-q8" in line


# ------------------------------------------------------------------ sizes


@pytest.mark.parametrize(
    "args, needle",
    [
        (
            ["run", "-p", "hi", "-c", "99999999999999999999999"],
            "-c/--ctx-size must be at most 16777216, got 99999999999999999999999",
        ),
        (["run", "-p", "hi", "-c", "16777217"], "-c/--ctx-size must be at most 16777216"),
        (
            ["bench", "-p", "99999999999999999999", "-n", "1", "-r", "1"],
            "bench: -d + max(-p, -n) must be at most 16777216 tokens",
        ),
        (
            ["bench", "-p", "1", "-n", "1", "-r", "1", "-d", "99999999999999999999"],
            "bench: -d + max(-p, -n) must be at most 16777216 tokens",
        ),
    ],
)
def test_sizes_no_machine_holds(args, needle):
    refused(kestrel(*args, "-t", "1"), needle)
