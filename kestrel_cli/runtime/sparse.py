"""Block-sparse attention as pure NumPy, the reference of the C kernel (docs/DESIGN.md
§3 Sparse selection).

The engine never calls `select_blocks`: the selection runs inside the attention kernel
(pyx/attn_select.h: `ka_probe`, `ka_pick`), per layer, per query head, and picks the same
blocks (tests/test_sparse.py). `importance_order` is shared: the KV cache computes it
once per prefill and the kernel takes its first (k + 1) // 2 existing blocks as the
importance picks.

Which importance a query sees: decode steps, the one recorded by all prefill calls so far
(tokens after the prompt have 0). A prefill call's sparse rows (causal prefix over k
blocks) see the importance recorded by the calls before it -- this call's own mass is
only known once all its rows are done -- so the rows of a first prompt pick by probes
alone; the next turn's prompt uses the first one's importance.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from kestrel_cli.core.errors import KestrelError, clip
from kestrel_cli.runtime.kernels import KV_BLOCK

BS = KV_BLOCK  # tokens per block: one KV cache block

SINKS = ("off", "in", "out")  # SparseSpec.sink values (kernel code: their index)
PROBES = ("sample", "bound", "sketch")  # SparseSpec.probe values
# SparseSpec.group values; the kernel's pool is the index ("share" / "rank": max and the
# share / rank flag)
GROUPS = ("head", "max", "sum", "union", "share", "rank")
RECENT_MAX = 63  # the kernel keeps at most this many recent blocks
REST_MAX_MAX = 255  # the rest's cap (rest-max) fits 8 bits


@dataclass(frozen=True)
class SparseSpec:
    """Every option of block-sparse attention (docs/DESIGN.md §3 Sparse selection and
    Options); the defaults are the plain selection ("seed"). `parse` reads the CLI's
    `--sparse NAME|opt+opt+...`, `str` writes the canonical spelling back.

    Args:
        k: blocks of 32 tokens each query head attends to (0: exact attention; the CLI
            takes >= 1).
        probes: keys probed per block (the sample probe).
        sink: "off"; "in": block 0 is always one of the k picks; "out": block 0 is
            attended besides the k picks.
        probe: "sample" (`probes` keys per block), "bound" (the per-block min/max key
            bound, kept as tokens are written) or "sketch" (every key also kept at 4 bits;
            a block ranked by its attention mass estimated from all its keys).
        group: "head" (each query head picks its own blocks); "max" / "sum": one
            selection per kv head from its query heads' pooled probes; "share": the same
            from the max of each head's probes less their log-sum-exp (with the sketch
            probe: each block's share of a head's attention); "rank": the same from the
            heads' own picks taken in turns; "union": each head picks, every head of the
            kv head attends the union.
        dense_first: the first N layers attend exactly.
        dense_layers: layer indices that attend exactly too (with dense_first: the union).
        window: > 0: a prefill records the importance of its last `window` rows only (the
            prompt's end, where the question is: SnapKV's observation window); 0: all.
        recent: the last R blocks (0..63) are attended besides the k picks.
        importance: False: no importance picks (step 2), all k by probes.
        rest: decode rows also count the blocks not picked, at 4 bits: each as one
            pseudo-token of score its sketch probe (estimated log-mass) and value its
            sketched values weighted by its tokens' sketched shares (needs probe
            "sketch"; prefill rows attend their picks only).
        rest_max: with rest, a head counts at most this many blocks it does not pick
            (1..255; those of the largest sketched masses, ties at the last all counting);
            0: every block above the floor (e^REST_FLOOR of the head's largest).
        prefill: "sparse", or "exact": prefill attends exactly, only decode is sparse.
    """

    k: int = 32
    probes: int = 8
    sink: str = "off"
    probe: str = "sample"
    group: str = "head"
    dense_first: int = 0
    dense_layers: tuple = ()
    window: int = 0
    recent: int = 0
    importance: bool = True
    rest: bool = False
    rest_max: int = 0
    prefill: str = "sparse"

    def __post_init__(self):
        layers = self.dense_layers
        if not isinstance(layers, (tuple, list)) or any(
            not isinstance(x, int) or isinstance(x, bool) for x in layers
        ):
            raise KestrelError(f"--sparse: dense takes layer indices, got {clip(layers)!r}")
        object.__setattr__(self, "dense_layers", tuple(sorted(set(layers))))
        bad = _check(self)
        if bad:
            raise KestrelError(f"--sparse: {bad}")

    @property
    def dense(self) -> tuple:
        """The layers that attend exactly, ascending."""
        return tuple(sorted(set(range(self.dense_first)) | set(self.dense_layers)))

    @property
    def sparse_prefill(self) -> bool:
        return self.prefill == "sparse"

    @property
    def width(self) -> int:
        """Most blocks a sparse query attends to: k, plus block 0 with the sink outside,
        plus the recent blocks."""
        return self.k + (self.sink == "out") + self.recent

    def kernel_opts(self, sketch: bool = False):
        """The options as the kernels read them (`kernels.SparseOpts`, attn_select.h
        ka_sparse); sketch: the cache's bounds arrays hold key sketches (a cache made with
        the sketch probe keeps them whatever probe reads)."""
        from kestrel_cli.runtime.kernels import SparseOpts

        pooled = self.group in ("share", "rank")
        return SparseOpts(
            n_probe=self.probes,
            sink=SINKS.index(self.sink),
            pool=GROUPS.index("max") if pooled else GROUPS.index(self.group),
            share=self.group == "share",
            rank=self.group == "rank",
            recent=self.recent,
            sketch=sketch,
            rest=self.rest,
            rest_max=self.rest_max if self.rest else 0,
        )

    @classmethod
    def parse(cls, text: str, k: int = 32, probes: int = 8) -> "SparseSpec":
        """The spec `text` names: a preset (`PRESETS`), or options joined by "+" applied
        in order over the plain selection, any of them a preset (`quality+recent=2`).
        k and probes: the values unless the text sets k= / probes=. One bad part raises
        KestrelError naming it."""
        fields: dict = {"k": k, "probes": probes}
        parts = str(text).strip().split("+")
        if not all(p.strip() for p in parts):
            raise KestrelError(
                f"--sparse: empty option in {clip(text)!r} (NAME or "
                f"opt+opt+...; options: {', '.join(_spellings())})"
            )
        for part in parts:
            fields.update(_option(part.strip()))
        if fields["k"] < 1:
            raise KestrelError(f"--sparse: k must be >= 1, got {fields['k']}")
        return cls(**fields)

    def __str__(self) -> str:
        """The canonical spelling: the preset closest to the options (fewest parts
        after it, the first such in PRESETS; "seed" is left out unless alone), then the
        options that differ from it in the table's order, then k= / probes= when not
        32 / 8. parse(str(s)) == s."""
        base = {f.name: f.default for f in fields(SparseSpec)}
        tail = [f"{n}={getattr(self, n)}" for n in ("k", "probes") if getattr(self, n) != base[n]]
        best = None
        for name, preset in PRESETS.items():
            ref = {**base, **preset}
            parts = [
                _spell(o[1], getattr(self, o[1]))
                for o in OPTIONS
                if o[1] not in ("k", "probes") and getattr(self, o[1]) != ref[o[1]]
            ]
            parts = parts if name == "seed" else [name, *parts]
            if best is None or len(parts) < len(best):
                best = parts
        return "+".join(best + tail) or "+".join(["seed", *tail])


# Presets: named option sets, `--sparse NAME` (options after it override). "seed" is the
# plain selection (docs/DESIGN.md §3).
PRESETS: dict[str, dict] = {
    "seed": {},
    # chosen on the bundled model (scripts/sparse_eval.py kld --shared-prefill and needle;
    # figures in docs/PERFORMANCE.md): an exact prefill gives exact prompt logits; each head attending its kv
    # head's union, all k picks by the decode query's sketch probe (blocks ranked by their
    # mass estimated from every key at 4 bits; no importance half), block 0 and the last
    # block besides the k, and the blocks not picked counted at 4 bits (rest): the lowest
    # decode KLD of the combinations tried (each part lowers it: the rest most, then the
    # sketch probe over sampled keys), every needle exact attention recalls kept at k = 8;
    # bound probe, pooled picks, dense layers, window: no better (docs/PERFORMANCE.md)
    "quality": {
        "prefill": "exact",
        "group": "union",
        "importance": False,
        "sink": "out",
        "recent": 1,
        "probe": "sketch",
        "rest": True,
    },
}

# The options of `--sparse opt+opt+...`: spelling, field, kind (a tuple: the values; int;
# "layers": comma-separated indices; bool: a flag, "no-NAME" turns it off), help. The
# table the CLI's help and the README show (`options_table`).
OPTIONS = (
    ("k", "k", int, "blocks of 32 tokens each query head attends to (>= 1; --sparse-k)"),
    ("probes", "probes", int, "keys probed per block by the sample probe (>= 1; --sparse-probes)"),
    (
        "sink",
        "sink",
        SINKS,
        "block 0 always attended: off, in (one of the k picks), out (besides them)",
    ),
    (
        "probe",
        "probe",
        PROBES,
        "block ranking: sample (probes keys), bound (per-block "
        "min/max key bound, Quest), sketch (every key kept at 4 bits, blocks ranked by "
        "their estimated attention mass)",
    ),
    (
        "group",
        "group",
        GROUPS,
        "head: each query head picks; max / sum: one pick per kv "
        "head from its heads' pooled probes; share: the same from each head's probes less "
        "their log-sum-exp; rank: the heads' own picks in turns; union: each head attends "
        "its kv head's union",
    ),
    ("dense-first", "dense_first", int, "the first N layers attend exactly"),
    ("dense", "dense_layers", "layers", "these layers (0,5,7) attend exactly"),
    ("window", "window", int, "prefill importance from the prompt's last N rows only; 0 = all"),
    ("recent", "recent", int, f"the last N blocks attended besides the k (0..{RECENT_MAX})"),
    (
        "importance",
        "importance",
        bool,
        "half of the k picks by prefill importance (no-importance: all k by probes)",
    ),
    (
        "rest",
        "rest",
        bool,
        "decode also counts the blocks not picked, at 4 bits (needs probe=sketch)",
    ),
    (
        "rest-max",
        "rest_max",
        int,
        f"with rest: at most N blocks not picked per head "
        f"(1..{REST_MAX_MAX}; 0 = all above the floor)",
    ),
    (
        "exact-prefill",
        "prefill",
        "exact",
        "exact prompt attention, sparse decode (sparse-prefill: both sparse)",
    ),
)
_BY_SPELLING = {o[0]: o for o in OPTIONS}
_BY_FIELD = {o[1]: o for o in OPTIONS}


def _spellings() -> list[str]:
    out = []
    for name, _, kind, _ in OPTIONS:
        if kind is bool:
            out.append(f"[no-]{name}")
        elif kind == "exact":
            out += ["exact-prefill", "sparse-prefill"]
        elif isinstance(kind, tuple):
            out.append(f"{name}={'|'.join(kind)}")
        elif kind == "layers":
            out.append(f"{name}=0,5,7")
        else:
            out.append(f"{name}=N")
    return out


def options_table() -> str:
    """The presets and the options, one per line: `--sparse`'s help and the README's."""
    rows = [
        f"{name}: {' + '.join(_spell(n, v) for n, v in p.items()) or 'the plain selection'}"
        for name, p in PRESETS.items()
    ]
    for name, _, kind, text in OPTIONS:
        spelled = (
            "exact-prefill / sparse-prefill"
            if kind == "exact"
            else f"{name} / no-{name}"
            if kind is bool
            else f"{name}={'|'.join(kind)}"
            if isinstance(kind, tuple)
            else f"{name}=0,5,7"
            if kind == "layers"
            else f"{name}=N"
        )
        rows.append(f"{spelled}: {text}")
    return "\n".join(rows)


def _spell(field: str, value) -> str:
    name, _, kind, _ = _BY_FIELD[field]
    if kind is bool:
        return name if value else f"no-{name}"
    if kind == "exact":
        return "exact-prefill" if value == "exact" else "sparse-prefill"
    if kind == "layers":
        return f"{name}={','.join(map(str, value))}"
    return f"{name}={value}"


def _option(part: str) -> dict:
    """The fields one part of a spec sets (a preset: all of its options)."""
    if part in PRESETS:
        return dict(PRESETS[part])
    if part in ("exact-prefill", "sparse-prefill"):
        return {"prefill": part.split("-")[0]}
    name, eq, value = part.partition("=")
    flag_off = (
        not eq
        and name.startswith("no-")
        and name[3:] in _BY_SPELLING
        and _BY_SPELLING[name[3:]][2] is bool
    )
    opt = _BY_SPELLING.get(name[3:] if flag_off else name)
    if opt is None:
        raise KestrelError(
            f"--sparse: unknown option or preset {clip(part)!r}; presets: "
            f"{', '.join(PRESETS)}; options: {', '.join(_spellings())}"
        )
    _, field, kind, _ = opt
    if kind is bool:
        if eq:
            raise KestrelError(
                f"--sparse: {name} takes no value (no-{name} turns it off), got {clip(part)!r}"
            )
        return {field: not flag_off}
    if not eq or kind == "exact":
        raise KestrelError(f"--sparse: {name} needs a value ({name}=...), got {clip(part)!r}")
    if isinstance(kind, tuple):
        if value not in kind:
            raise KestrelError(
                f"--sparse: {name} must be one of {', '.join(kind)}; got {clip(value)!r}"
            )
        return {field: value}
    try:
        if kind == "layers":
            return {field: tuple(int(x) for x in value.split(",") if x.strip())}
        return {field: int(value)}
    except ValueError:
        what = "comma-separated layer indices" if kind == "layers" else "an integer"
        raise KestrelError(f"--sparse: {name} takes {what}, got {clip(value)!r}") from None


def _check(s: SparseSpec) -> str | None:
    """What is wrong with s (the first bad value), or None."""
    for name in ("k", "probes", "dense_first", "window", "recent", "rest_max"):
        v = getattr(s, name)
        if not isinstance(v, int) or isinstance(v, bool):
            return f"{_BY_FIELD[name][0]} must be an integer, got {clip(v)!r}"
    if s.k < 0:
        return f"k must be >= 0 (0: exact attention), got {s.k}"
    if s.probes < 1:
        return f"probes must be >= 1, got {s.probes}"
    for name, ok in (
        ("sink", SINKS),
        ("probe", PROBES),
        ("group", GROUPS),
        ("prefill", ("sparse", "exact")),
    ):
        if getattr(s, name) not in ok:
            return f"{name} must be one of {', '.join(ok)}; got {clip(getattr(s, name))!r}"
    if s.dense_first < 0:
        return f"dense-first must be >= 0, got {s.dense_first}"
    if any(x < 0 for x in s.dense_layers):
        return f"dense: layer indices must be >= 0, got {clip(s.dense_layers)}"
    if s.window < 0:
        return f"window must be >= 0, got {s.window}"
    if not 0 <= s.recent <= RECENT_MAX:
        return f"recent must be 0..{RECENT_MAX}, got {s.recent}"
    if not 0 <= s.rest_max <= REST_MAX_MAX:
        return f"rest-max must be 0..{REST_MAX_MAX}, got {s.rest_max}"
    if s.k and s.rest and s.probe != "sketch":
        return (
            "rest needs the sketch probe (probe=sketch): the rest is weighed by the "
            "sketch's block masses"
        )
    if s.k and s.rest_max and not s.rest:
        return "rest-max caps the rest: it needs rest"
    return None


def block_importance(importance: np.ndarray, seq_len: int, bs: int = BS) -> np.ndarray:
    """imp[b] = sum of importance[t] over block b's tokens t < seq_len, float64 (n_blocks,)."""
    nb = -(-seq_len // bs)
    imp = np.zeros(nb * bs, dtype=np.float64)
    imp[:seq_len] = np.asarray(importance, dtype=np.float32)[:seq_len]
    return imp.reshape(nb, bs).sum(axis=1)


def importance_order(importance: np.ndarray, seq_len: int, bs: int = BS) -> np.ndarray:
    """Blocks of the first seq_len tokens by importance, descending, ties to the lower
    index: int32 (n_blocks,). Taking its leading entries is step 2 of the selection."""
    imp = block_importance(importance, seq_len, bs)
    return np.lexsort((np.arange(imp.shape[0]), -imp)).astype(np.int32)


def probe_scores(q: np.ndarray, keys: np.ndarray, n_probe: int = 8, bs: int = BS) -> np.ndarray:
    """probe[b] = max of q . K[ps] over ps in range(p0, p_end, max(1, (p_end - p0) // n_probe))."""
    seq = keys.shape[0]
    nb = -(-seq // bs)
    out = np.empty(nb, dtype=np.float32)
    for b in range(nb):
        p0, p_end = b * bs, min(b * bs + bs, seq)
        step = max(1, (p_end - p0) // n_probe)
        out[b] = (keys[p0:p_end:step].astype(np.float32) @ q.astype(np.float32)).max()
    return out


def key_bounds(keys: np.ndarray, bs: int = BS) -> tuple[np.ndarray, np.ndarray]:
    """(hi, lo): per block the elementwise max and min of its keys, float32
    (n_blocks, head_dim) each: the bound probe's summary (docs/DESIGN.md §3 Options)."""
    seq, hd = keys.shape
    nb = -(-seq // bs)
    hi = np.empty((nb, hd), np.float32)
    lo = np.empty((nb, hd), np.float32)
    for b in range(nb):
        blk = keys[b * bs : min(b * bs + bs, seq)].astype(np.float32)
        hi[b], lo[b] = blk.max(axis=0), blk.min(axis=0)
    return hi, lo


def key_bounds_q8(keys: np.ndarray, bs: int = BS) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The int8 cache's bounds: (hi, lo) int8 (n_blocks, head_dim) and the scale S
    float32 (n_blocks,): key_bounds of the dequantised keys divided by S = their largest
    magnitude / 127, rounded outward (ceil hi, floor lo) and clamped to +-127."""
    hi, lo = key_bounds(keys, bs)
    m = np.maximum(np.abs(hi).max(axis=1), np.abs(lo).max(axis=1)).astype(np.float32)
    s = (m / np.float32(127.0)).astype(np.float32)
    safe = np.where(s > 0, s, np.float32(1.0))[:, None]
    qh = np.where(s[:, None] > 0, np.ceil(hi / safe), 0).clip(-127, 127).astype(np.int8)
    ql = np.where(s[:, None] > 0, np.floor(lo / safe), 0).clip(-127, 127).astype(np.int8)
    return qh, ql, s


def bound_scores(
    q: np.ndarray, hi: np.ndarray, lo: np.ndarray, scale: np.ndarray | None = None
) -> np.ndarray:
    """The bound probe: score[b] = sum over channels c of max(q[c] * hi[b, c],
    q[c] * lo[b, c]) (times scale[b] for int8 bounds), an upper bound of q . k for every
    key k of block b (Quest). float32 (n_blocks,)."""
    q = q.astype(np.float32)
    s = np.maximum(q * hi.astype(np.float32), q * lo.astype(np.float32)).sum(axis=1)
    if scale is not None:
        s = s * scale
    return s.astype(np.float32)


def key_sketch(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The sketch probe's summary of keys (seq, head_dim), as the cache keeps it (docs/
    DESIGN.md §3 Options): per token S = max|k| / 7 and u = clip(rint(k / S), -7, 7) + 8,
    packed two per byte (dim j low, dim j + head_dim/2 high): (uint8 (seq, head_dim / 2),
    float32 (seq,))."""
    k = np.asarray(keys, np.float32)
    h2 = k.shape[1] // 2
    m = np.abs(k).max(axis=1)
    inv = np.where(
        m > 0, np.float32(7.0) / np.where(m > 0, m, np.float32(1.0)), np.float32(0.0)
    ).astype(np.float32)
    u = (np.clip(np.rint(k * inv[:, None]), -7, 7) + 8).astype(np.uint8)
    return u[:, :h2] | (u[:, h2:] << 4), (m / np.float32(7.0)).astype(np.float32)


def value_nibbles(raw: np.ndarray, head_dim: int, bs: int = BS) -> np.ndarray:
    """The 4-bit values of sketched blocks as the cache lays them out for the rest's dots
    (attn_kv.h ka_sketch_vrow: dims along lanes, byte (p * head_dim + d) * 4 + i holding
    token 8p + i's nibble low and token 8p + 4 + i's high): raw uint8 (n_blocks,
    bs * head_dim / 2) -> u uint8 (n_blocks * bs, head_dim), 1..15 (0 where unwritten)."""
    x = np.asarray(raw, np.uint8).reshape(-1, bs // 8, head_dim, 4)
    u = np.concatenate([x & 15, x >> 4], axis=3)  # (nb, p, d, 8): token 8p + i
    return u.transpose(0, 1, 3, 2).reshape(-1, head_dim)


def sketch_token_scores(
    q: np.ndarray, packed: np.ndarray, scales: np.ndarray, scale: float
) -> np.ndarray:
    """Each sketched key's score, scale * q~ . k~_t - cv * S_t^2 (see `sketch_scores`):
    float32 (seq,)."""
    q = np.asarray(q, np.float32)
    m = np.abs(q).max()
    qi = np.rint(q * (np.float32(127.0) / m if m > 0 else np.float32(0.0))).astype(np.int64)
    qs = np.float32(m / np.float32(127.0)) * np.float32(scale)
    u = np.concatenate([packed & 15, packed >> 4], axis=1).astype(np.int64)
    acc = u @ qi - 8 * qi.sum()
    cv = np.float32(qs * qs * np.float32(int((qi * qi).sum())) / np.float32(24.0))
    return acc.astype(np.float32) * (scales * qs) - cv * scales * scales


def sketch_scores(
    q: np.ndarray, packed: np.ndarray, scales: np.ndarray, scale: float, bs: int = BS
) -> np.ndarray:
    """The sketch probe: score[b] = log sum over block b's tokens t of exp(scale * q~ . k~_t
    - cv * S_t^2), q~ = rint(q / Sq) * Sq at int8 (Sq = max|q| / 127), k~ the sketched
    keys (`key_sketch`, S_t their scales), cv = (Sq scale)^2 |q~ / Sq|^2 / 24 (the
    rounding noise's variance, whose exp would inflate the mass, taken off): the block's
    attention mass estimated from all its keys. float32."""
    s = sketch_token_scores(q, packed, scales, scale)
    n = s.shape[0]
    nb = -(-n // bs)
    x = np.full(nb * bs, -np.inf)
    x[:n] = s
    x = x.reshape(nb, bs)
    mx = x.max(axis=1)
    return (mx + np.log(np.exp(x - mx[:, None]).sum(axis=1))).astype(np.float32)


def _picks(
    score: np.ndarray, importance_picks: list[int], k: int, nb: int, taken: set[int]
) -> list[int]:
    """Steps 3-4: fill k - len(importance_picks) picks by score (descending, ties to the
    lower index) among blocks not taken, then the recency swap."""
    n_imp = len(importance_picks)
    by_probe = [
        b for b in np.lexsort((np.arange(nb), -score.astype(np.float64))) if int(b) not in taken
    ]
    probe_picks = [int(b) for b in by_probe[: k - n_imp]]
    if probe_picks and nb - 1 not in taken and nb - 1 not in probe_picks:
        probe_picks[-1] = nb - 1  # the last pick is the lowest probe, ties: higher index
    return importance_picks + probe_picks


def select_with(
    score: np.ndarray,
    importance: np.ndarray | None,
    seq: int,
    k: int,
    sink: str = "off",
    bs: int = BS,
    recent: int = 0,
) -> np.ndarray:
    """Steps 2-4 over given block scores, with the sink and recent options: block 0 first,
    then the last `recent` blocks, then steps 2-4 over the other blocks with k - 1 picks
    (sink "in") or k ("out", "off"). All blocks ascending while n_blocks <= k (+ 1 with
    "out", + recent)."""
    nb = -(-seq // bs)
    total = k + (sink == "out") + recent
    if nb <= total:
        return np.arange(nb, dtype=np.int64)
    head: list[int] = []
    if sink != "off":
        head, k = [0], k - (sink == "in")
    head += [b for b in range(max(1, nb - recent), nb) if b not in head]
    taken = set(head)
    picks: list[int] = []
    if importance is not None:
        for b in importance_order(importance, seq, bs):
            if len(picks) >= (k + 1) // 2:
                break
            if int(b) not in taken:
                picks.append(int(b))
                taken.add(int(b))
    return np.array(head + _picks(score, picks, k, nb, taken), dtype=np.int64)


def select_blocks_opts(
    q: np.ndarray,
    keys: np.ndarray,
    importance: np.ndarray | None,
    k: int,
    n_probe: int = 8,
    bs: int = BS,
    *,
    sink: str = "off",
    probe: str = "sample",
    bounds=None,
    recent: int = 0,
    scale: float = 1.0,
) -> np.ndarray:
    """`select_blocks` with the options (docs/DESIGN.md §3 Options): sink "off" / "in" /
    "out"; probe "sample", "bound" (scores from `bound_scores` over `bounds` = (hi, lo)
    or (hi, lo, scale), default key_bounds(keys)) or "sketch" (`sketch_scores` at the
    softmax scale `scale` over `bounds` = (packed, scales), default key_sketch(keys));
    the last `recent` blocks besides the k. Defaults: select_blocks."""
    if probe == "sketch":
        score = sketch_scores(q, *(key_sketch(keys) if bounds is None else bounds), scale, bs)
    elif probe == "bound":
        b = key_bounds(keys, bs) if bounds is None else bounds
        score = bound_scores(q, *b)
    else:
        score = probe_scores(q, keys, n_probe, bs)
    return select_with(score, importance, keys.shape[0], k, sink, bs, recent)


def pool_scores(scores, pool: str) -> np.ndarray:
    """One selection's block scores from a kv head's query heads' (attn_select.h
    ka_pool_probes): folded in head order by max ("max") or sum ("sum"); "share": the max
    of each head's scores less their log-sum-exp over the blocks (the block's share of the
    head's estimated attention with the sketch probe). float32 (n_blocks,)."""
    out = None
    for x in scores:
        x = np.asarray(x, np.float32)
        if pool == "share":
            m = x.max()
            x = (x - (m + np.log(np.exp(x - m).sum(dtype=np.float32)))).astype(np.float32)
        if out is None:
            out = x.copy()
        else:
            out = (out + x).astype(np.float32) if pool == "sum" else np.maximum(out, x)
    return out


def group_scores(scores, pool: str, pick=None) -> list[np.ndarray]:
    """The block scores each query head of one kv head selects from (attn_select.h): its
    own ("head", "union"), or one pooled score for all: "max" / "sum" / "share" by
    `pool_scores`; "rank" (ka_rank_pool): from each head's picks alone, pick(score) in pick
    order, block b scores -(r * group + g) at its first place r in head g's (-inf in
    none), so picking from it takes the heads' picks in turns."""
    if pool in ("head", "union"):
        return list(scores)
    if pool != "rank":
        return [pool_scores(scores, pool)] * len(scores)
    group = len(scores)
    out = np.full(len(scores[0]), -np.inf, np.float32)
    for g, s in enumerate(scores):
        for r, b in enumerate(pick(s)):
            out[b] = max(out[b], np.float32(-(r * group + g)))
    return [out] * group


def select_group(
    qs: np.ndarray,
    keys: np.ndarray,
    importance: np.ndarray | None,
    k: int,
    pool: str,
    n_probe: int = 8,
    bs: int = BS,
    *,
    sink: str = "off",
    probe: str = "sample",
    bounds=None,
    scale: float = 1.0,
) -> list[np.ndarray]:
    """The blocks each of the query heads qs (group, head_dim) of one kv head attends to
    with one selection per kv head: pool "max" / "sum" / "share" / "rank" picks once from
    the heads' scores pooled (`group_scores`); "union" picks per head and each attends the union (ascending).
    Returns one array per head (pick order for max / sum)."""
    if pool == "union":
        each = [
            select_blocks_opts(
                q,
                keys,
                importance,
                k,
                n_probe,
                bs,
                sink=sink,
                probe=probe,
                bounds=bounds,
                scale=scale,
            )
            for q in qs
        ]
        u = np.unique(np.concatenate(each)).astype(np.int64)
        return [u for _ in qs]
    scores = []
    for q in qs:
        if probe == "sketch":
            scores.append(
                sketch_scores(q, *(key_sketch(keys) if bounds is None else bounds), scale, bs)
            )
        elif probe == "bound":
            b = key_bounds(keys, bs) if bounds is None else bounds
            scores.append(bound_scores(q, *b))
        else:
            scores.append(probe_scores(q, keys, n_probe, bs))

    def pick(x):
        return select_with(x, importance, keys.shape[0], k, sink, bs)

    sel = pick(group_scores(scores, pool, pick)[0])
    return [sel for _ in qs]


def select_blocks(
    q: np.ndarray,
    keys: np.ndarray,
    importance: np.ndarray | None,
    k: int,
    n_probe: int = 8,
    bs: int = BS,
) -> np.ndarray:
    """The blocks one query head attends to (docs/DESIGN.md §3), in pick order.

    Args:
        q: float32 (head_dim,) the query head.
        keys: float32 (seq_len, head_dim) the keys of its kv head.
        importance: float32 (seq_len,) prefill attention mass per token, or None.
        k: blocks to pick (>= 1).
        n_probe: keys probed per block.
        bs: tokens per block.
    Returns:
        int64 block indices: importance picks, then probe picks by descending probe, with
        the recency swap applied in place; all blocks ascending when n_blocks <= k.
    """
    if k < 1 or n_probe < 1:
        raise ValueError(f"select_blocks: k and n_probe must be >= 1, got {k}, {n_probe}")
    seq = keys.shape[0]
    nb = -(-seq // bs)
    if nb <= k:
        return np.arange(nb, dtype=np.int64)
    probe = probe_scores(q, keys, n_probe, bs)
    picks: list[int] = []
    if importance is not None:
        order = importance_order(importance, seq, bs)
        picks = [int(b) for b in order[: (k + 1) // 2]]
    return np.array(_picks(probe, picks, k, nb, set(picks)), dtype=np.int64)
