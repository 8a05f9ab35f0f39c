"""What a KV cache costs in memory, and the checks made with it (docs/DESIGN.md §1).

A cache takes its memory block by block as tokens arrive (runtime/kv_cache.BlockPool), so a
context of 128K tokens costs nothing until it is used. The checks are made where the tokens
are known: a request (a prompt and the tokens it may generate) whose KV cache would not fit
the memory available now is refused up front, before its prefill, in one line that says what
it needs and what helps. At start only a context that could never fit the RAM is refused
(`check_kv_ram`: an explicit -c, or --parallel caches)."""

from __future__ import annotations

from kestrel_cli.core import osmem
from kestrel_cli.core.errors import KestrelError
from kestrel_cli.runtime.kv_cache import KV_BLOCK


def human_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def kv_cache_bytes(eng, tokens: int) -> int:
    """Bytes one KV cache of `eng`'s spec holds once `tokens` tokens fill it: K and V blocks
    of every layer, the per-token importance, and the sparse probes' per-block bounds or
    sketches. The cache takes its memory as it fills (kv_cache.BlockPool), so this is its
    size at `tokens`, not at start. With a draft model (--draft) its cache, which holds the
    same tokens, is counted too."""
    c = eng.cache
    blocks = -(-tokens // KV_BLOCK)
    n = 2 * c.n_layers * blocks * c.block_bytes + 4 * c.n_layers * tokens
    for a in (c.bounds, c.bound_scales):  # sized by the cache's own blocks
        if a is not None:
            n += a.nbytes // max(1, c.k_ptrs.shape[1]) * blocks
    spec = getattr(eng, "speculator", None)
    if spec is not None:
        n += kv_cache_bytes(spec.draft, tokens)
    return n


def kv_held_bytes(eng) -> int:
    """Bytes the engine's cache holds now (its blocks, reused by the next request)."""
    return kv_cache_bytes(eng, eng.cache.n_blocks * KV_BLOCK) if eng.cache.n_blocks else 0


def check_ram(eng, tokens: int, slots: int = 1, hint: str = "") -> None:
    """Refuse when `slots` KV caches of `tokens` tokens and the weights cannot fit this
    machine's RAM even with nothing else running (they would fail mid-answer, or wake the
    OOM killer)."""
    ram = osmem.physical_memory()
    if not ram:
        return
    kv = slots * kv_cache_bytes(eng, tokens)
    weights = int(getattr(eng.store, "nbytes", 0) or 0)
    if kv + weights > ram:
        what = (
            f"{slots} KV caches of {tokens} tokens need"
            if slots > 1
            else f"a KV cache of {tokens} tokens needs"
        )
        raise KestrelError(
            f"{what} {human_bytes(kv)} when full (besides {human_bytes(weights)}"
            f" of weights), more than this machine's {human_bytes(ram)} of "
            f"memory (lower {hint or '-c/--ctx-size'}, or use --kv-q8)"
        )


def request_shortfall(engines, tokens: int) -> tuple[int, int] | None:
    """(bytes needed, bytes available) when a request of `tokens` tokens (prompt and
    generated) on any of `engines` (the slot it lands on: the one holding the least) needs
    more KV cache memory than is available now; None when it fits or the OS does not say."""
    avail = osmem.available_memory()
    if avail is None:
        return None
    need = min(max(0, kv_cache_bytes(e, tokens) - kv_held_bytes(e)) for e in engines)
    return (need, avail) if need > avail else None


def shortfall_text(tokens: int, need: int, avail: int, hint: str) -> str:
    return (
        f"the KV cache of this request's {tokens} tokens needs {human_bytes(need)} more "
        f"memory, and {human_bytes(avail)} is available (use --kv-q8, or {hint})"
    )


def check_request(eng, tokens: int, hint: str) -> None:
    """Refuse, before prefill, a request of `tokens` tokens (prompt + those it may
    generate) whose KV cache would not fit the memory available now."""
    short = request_shortfall([eng], tokens)
    if short is not None:
        raise KestrelError(shortfall_text(tokens, *short, hint))
