"""Admission before work (issue 33): a request takes a queue place and a share of the memory
budget before its template is rendered, its prompt tokenised or its grammar compiled; a prompt
far over the context is refused after tokenising about a context of it; the API key is one
header and never empty; 503 server_busy says when to retry."""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from test_server_limits import CHAT, chat, post_all, start_server

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from conftest import make_checkpoint
    from kestrel_cli import Engine

    d = tmp_path_factory.mktemp("tiny") / "tiny-qwen3"
    make_checkpoint(d, "qwen3")
    return Engine.from_pretrained(d, threads=1, ctx_size=64)


def cjk(n: int, seed: int = 1) -> str:
    """`n` random CJK characters: several byte-level tokens each, no whitespace to cut at."""
    rnd = random.Random(seed)
    return "".join(chr(rnd.randint(0x4E00, 0x9FFF)) for _ in range(n))


# ---------------------------------------------------------------------------- tokenising


def test_a_prompt_far_over_the_context_is_tokenised_only_in_part(smollm2_engine, monkeypatch):
    """The tokenizer never sees the whole of a 200K-character prompt (under the character cap)
    for an 8192-token context: it is refused after a piece or two, as 'at least N tokens'."""
    from conftest import record_tokenised
    from kestrel_cli.server import create_app
    from kestrel_cli.text.tokenizer import COUNT_CHUNK_CHARS

    tiny = smollm2_engine
    seen = record_tokenised(monkeypatch, tiny.tokenizer)
    text = cjk(200_000)
    r, c = post_all(
        create_app([tiny]),
        [(CHAT, chat(text)), ("/v1/completions", {"prompt": text, "max_tokens": 1})],
    )
    for resp, param in ((r, "messages"), (c, "prompt")):
        assert resp.status_code == 400, resp.text
        err = resp.json()["error"]
        assert err["code"] == "context_length_exceeded" and err["param"] == param
        assert "at least" in err["message"], err
    assert seen and max(seen) <= COUNT_CHUNK_CHARS, max(seen)
    assert sum(seen) <= 4 * COUNT_CHUNK_CHARS, sum(seen)


def test_six_near_cap_prompts_at_once_stay_within_memory(tmp_path):
    """A real server (bundled model, 4096 context): six prompts just under the character cap
    (7.8 MB bodies) at once are refused with 400, the server's peak RSS stays well under
    1.5 GB over its idle RSS (they used to peak at +0.8 GB each), and it returns near idle."""
    proc, url, _ = start_server(tmp_path, ctx=4096)
    try:

        def status(key):
            for line in Path(f"/proc/{proc.pid}/status").read_text().splitlines():
                if line.startswith(key):
                    return int(line.split()[1]) << 10

        idle = status("VmRSS:")
        body = json.dumps(
            {"messages": [{"role": "user", "content": cjk(1_300_000)}], "max_tokens": 1}
        ).encode()
        out = []

        def post():
            out.append(
                httpx.post(
                    url + CHAT,
                    content=body,
                    timeout=120,
                    headers={"content-type": "application/json"},
                )
            )

        threads = [threading.Thread(target=post) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [r.status_code for r in out] == [400] * 6, [r.text[:200] for r in out]
        assert all(r.json()["error"]["code"] == "context_length_exceeded" for r in out)
        peak = status("VmHWM:")
        assert peak - idle < 512 << 20, (idle >> 20, peak >> 20)
        assert httpx.get(url + "/health").json()["requests_preparing"] == 0
    finally:
        proc.kill()
        proc.wait(10)


# ---------------------------------------------------------------------------- admission


def test_the_queue_bound_holds_before_tokenising(tiny, monkeypatch):
    """With every place taken (requests in preparation count), the next request gets 503
    server_busy with Retry-After, and its prompt is never rendered or tokenised."""
    from kestrel_cli.server import create_app

    app = create_app([tiny], queue_size=2)

    def never(*a, **k):
        raise AssertionError("tokenised a request that had no place")

    monkeypatch.setattr(tiny, "encode_prompt", never)
    app.state.scheduler.preparing = 3  # one slot + a queue of 2, all preparing
    r, c = post_all(app, [(CHAT, chat()), ("/v1/completions", {"prompt": "hi"})])
    for resp in (r, c):
        assert resp.status_code == 503, resp.text
        assert resp.json()["error"]["code"] == "server_busy"
        assert resp.headers["retry-after"] == "1"


def test_the_memory_budget_is_taken_before_work_and_given_back(tiny, monkeypatch):
    """A request over --max-request-memory is 413 before any work; with the budget held by
    others, 503 server_busy with Retry-After; an admitted request gives its share back."""
    from kestrel_cli.server import Limits, create_app
    from kestrel_cli.server.admission import MiB, prep_cost

    need = prep_cost(len("Say hi."), tiny.ctx_size)
    limits = Limits(memory_budget=4 * need, max_request_memory=2 * need)
    app = create_app([tiny], limits=limits)
    (ok,) = post_all(app, [(CHAT, chat())])
    assert ok.status_code == 200, ok.text
    assert app.state.budget.used == 0  # given back once the reply was sent
    app = create_app([tiny], limits=limits)  # (post_all ends an app's lifespan)
    budget = app.state.budget
    budget.used = 3 * need  # others hold most of it
    calls = []
    real = tiny.encode_prompt
    monkeypatch.setattr(tiny, "encode_prompt", lambda *a, **k: calls.append(1) or real(*a, **k))
    (busy,) = post_all(app, [(CHAT, chat())])
    (big,) = post_all(
        create_app([tiny], limits=Limits(memory_budget=4 * need, max_request_memory=need // 2)),
        [(CHAT, chat())],
    )
    assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
    assert busy.json()["error"]["code"] == "server_busy"
    assert "--memory-budget" in busy.json()["error"]["message"]
    assert big.status_code == 413, big.text
    assert big.json()["error"]["code"] == "request_too_large"
    assert "--max-request-memory" in big.json()["error"]["message"]
    assert not calls and budget.used == 3 * need
    assert need < 16 * MiB


def test_a_body_is_charged_as_it_arrives(tiny):
    """Body bytes count against the budget while they are read: a 1 MiB body with 2 MiB of
    budget left is 503 before it is parsed."""
    from kestrel_cli.server import Limits, create_app
    from kestrel_cli.server.admission import MiB

    app = create_app([tiny], limits=Limits(memory_budget=64 * MiB, max_request_memory=64 * MiB))
    app.state.budget.used = 62 * MiB
    (r,) = post_all(app, [(CHAT, chat("y" * MiB))])
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy", r.text
    assert app.state.budget.used == 62 * MiB


def test_memory_flags_are_checked_and_logged(tmp_path):
    for args, needle in (
        (["--memory-budget", "0"], "--memory-budget"),
        (["--memory-budget", "lots"], "--memory-budget"),
        (["--max-request-memory", "-5"], "--max-request-memory"),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "kestrel_cli.cli", "serve", *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert r.returncode != 0 and needle in r.stderr and "Traceback" not in r.stderr, r.stderr
    proc, url, log = start_server(
        tmp_path, "--memory-budget", "300M", "--max-request-memory", "100M"
    )
    try:
        assert "memory budget 300 MiB, 100 MiB a request" in log.read_text()
    finally:
        proc.kill()
        proc.wait(10)


# ---------------------------------------------------------------------------- the key


def test_an_empty_api_key_is_refused_at_start():
    """`--api-key ""` (as `--api-key "$KEY"` with KEY unset) is one error line before the
    model is loaded; it used to serve asking for a key that an empty Bearer satisfied. (An
    empty KESTREL_API_KEY counts as unset, as click reads every environment variable.)"""
    for args in (["--api-key", ""], ["--api-key", "  "]):
        r = subprocess.run(
            [sys.executable, "-m", "kestrel_cli.cli", "serve", "-c", "64", *args],
            capture_output=True,
            text=True,
            timeout=60,
            cwd=ROOT,
        )
        assert r.returncode != 0, r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "api-key" in lines[0] and "empty" in lines[0], r.stderr


def test_one_authorization_header_with_the_key(tiny):
    from kestrel_cli.server import create_app

    app = create_app([tiny], api_key="k")

    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://k") as c:
            out = []
            for headers in (
                [("authorization", "Bearer wrong"), ("authorization", "Bearer k")],
                [("authorization", "Bearer k"), ("authorization", "Bearer k")],
                [("authorization", "Bearer ")],
                [("authorization", "Bearer")],
                [("authorization", "Bearer k")],
            ):
                out.append((await c.get("/v1/models", headers=headers)).status_code)
            return out

    assert asyncio.run(main()) == [401, 401, 401, 401, 200]


def test_retry_after_on_the_connection_cap(tmp_path):
    from test_server_limits import connect, read_all

    proc, url, _ = start_server(tmp_path, "--max-connections", "1")
    try:
        with connect(url) as held:
            time.sleep(0.2)
            with connect(url) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                raw, _ = read_all(s, 8)
            held.close()
        head = raw.partition(b"\r\n\r\n")[0].lower()
        assert head.startswith(b"http/1.1 503") and b"\r\nretry-after: 1\r\n" in head, raw
    finally:
        proc.kill()
        proc.wait(10)


# ---------------------------------------------------------------------------- the model at fault


def test_nan_weights_are_a_500_model_error_and_the_server_goes_on(tmp_path):
    """A model whose weights hold NaN: each request gets 500 `model_error` naming the cause
    (it used to be 500 'internal error: ValueError' from the sampler), and /health stays ok."""
    from safetensors.numpy import load_file, save_file

    from conftest import make_checkpoint
    from kestrel_cli import Engine
    from kestrel_cli.server import create_app

    make_checkpoint(tmp_path, "qwen3")
    f = next(tmp_path.glob("*.safetensors"))
    w = load_file(f)
    w["model.norm.weight"][:] = float("nan")
    save_file(w, f, metadata={"format": "pt"})
    eng = Engine.from_pretrained(tmp_path, threads=1, ctx_size=64)
    r, s = post_all(create_app([eng]), [(CHAT, chat()), (CHAT, chat(temperature=0.8))])
    for resp in (r, s):
        assert resp.status_code == 500, resp.text
        err = resp.json()["error"]
        assert err["code"] == "model_error" and "non-finite" in err["message"], err


# ---------------------------------------------------------------------------- images


@pytest.fixture(scope="module")
def vl_engine(tmp_path_factory):
    from test_qwen3_vl import make_vl_checkpoint

    from kestrel_cli import Engine

    d = tmp_path_factory.mktemp("vl")
    make_vl_checkpoint(d)
    return Engine.from_pretrained(d, threads=1, ctx_size=128)


def image_chat(urls, text="Compare."):
    return chat(
        [{"type": "image_url", "image_url": {"url": u}} for u in urls]
        + [{"type": "text", "text": text}]
    )


def test_bomb_images_are_refused_before_any_is_decoded(vl_engine, no_decoding):
    """Eight 9000 x 9000 PNGs of ~10 KB (the issue's 103 KB body, 4.4 GB peak): refused from
    their headers; nothing decoded, nothing rendered; so are too many images, images whose
    tokens fill the context, an EPS sent as image/png, and images for a model without a
    vision tower. A small image in the same server is answered."""
    from test_images import data_url, eps_bytes, png_bomb

    from kestrel_cli.models.images import MAX_IMAGES_PER_PROMPT
    from kestrel_cli.server import create_app

    bomb, small, wide = (
        data_url(png_bomb(9000, 9000)),
        data_url(png_bomb(64, 64)),
        data_url(png_bomb(4000, 4000)),
    )
    per = vl_engine.image_config().tokens_for(4000, 4000)  # at the checkpoint's max_pixels
    fill = -(-vl_engine.ctx_size // per)  # that many fill the context
    assert fill <= MAX_IMAGES_PER_PROMPT
    reqs = [
        (CHAT, image_chat([bomb] * 8)),
        (CHAT, image_chat([small] * (MAX_IMAGES_PER_PROMPT + 1))),
        (CHAT, image_chat([wide] * fill)),
        (CHAT, image_chat([data_url(eps_bytes())])),
    ]
    out = post_all(create_app([vl_engine]), reqs)
    for r, needle in zip(out, ("too large", "images in one request", "no room", "PNG, JPEG")):
        assert r.status_code == 400, r.text
        assert needle in r.json()["error"]["message"], r.text
    assert out[2].json()["error"]["code"] == "context_length_exceeded"
    assert not no_decoding, no_decoding


def test_image_cost_is_leased(vl_engine, monkeypatch):
    """An image request takes what decoding its images will cost from the budget (header
    sizes): with too little budget left it is 503 before any decoding; a small image is
    answered and the lease given back."""
    from test_images import data_url, png_bomb

    from kestrel_cli.server import Limits, create_app
    from kestrel_cli.server.admission import MiB

    big = data_url(png_bomb(2000, 1000))  # 2 M pixels, resized to fit the tokens
    cfg = vl_engine.image_config()
    cost = cfg.decode_cost(2000, 1000, "PNG")
    app = create_app(
        [vl_engine],
        limits=Limits(memory_budget=cost + 64 * MiB, max_request_memory=cost + 64 * MiB),
    )
    app.state.budget.used = 64 * MiB
    decoded = []
    monkeypatch.setattr(
        "kestrel_cli.models.images.prepare",
        lambda *a, **k: decoded.append(1) or (_ for _ in ()).throw(AssertionError("decoded")),
    )
    (r,) = post_all(app, [(CHAT, image_chat([big]))])
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_busy", r.text
    assert not decoded
    app = create_app(
        [vl_engine],
        limits=Limits(memory_budget=cost + 64 * MiB, max_request_memory=cost + 64 * MiB),
    )
    monkeypatch.undo()
    (ok,) = post_all(app, [(CHAT, image_chat([data_url(png_bomb(64, 64))]))])
    assert ok.status_code == 200, ok.text
    assert app.state.budget.used == 0
