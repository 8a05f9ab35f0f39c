"""Engine: a loaded model, its tokenizer and one conversation's KV cache
(docs/DESIGN.md §1 Layers)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import numpy as np

from kestrel_cli.core import cpus
from kestrel_cli.core.errors import KestrelError
from kestrel_cli.formats.weights import QUANT_FORMATS
from kestrel_cli.inference.generate import Chunk, stream_generate
from kestrel_cli.inference.sampling import check_params, make_sampler
from kestrel_cli.models import resolve
from kestrel_cli.models.llama import ACT_MODES
from kestrel_cli.models.loader import open_checkpoint
from kestrel_cli.runtime.kv_cache import CacheSpec
from kestrel_cli.runtime.sparse import SparseSpec
from kestrel_cli.text import think_budget
from kestrel_cli.text.tokenizer import TooManyTokens

THREADS_PER_CORE = 4
THREADS_FLOOR = 64  # allowed on any machine
THREADS_MAX = 512  # never more (ggml's GGML_MAX_N_THREADS)
MAX_CTX = 1 << 24  # -c: far past any model's context (numpy's arrays fail first)


def thread_cap() -> int:
    """The most threads one engine may start (past a few thousand libgomp fails to create
    them, or crashes): THREADS_PER_CORE per core, at least THREADS_FLOOR, at most
    THREADS_MAX."""
    cores = os.cpu_count() or 1
    return min(THREADS_MAX, max(THREADS_FLOOR, THREADS_PER_CORE * cores))


def thread_rule() -> str:
    return f"{THREADS_PER_CORE} per core, at least {THREADS_FLOOR}, at most {THREADS_MAX}"


EXPERTS_MARGIN = 1 << 30  # memory left over once the experts are copied


def experts_fit(store) -> tuple[bool, str]:
    """Whether a MoE model's weights, copied off the file at load (experts in the decode
    layout, the rest on huge pages; their file pages let go), fit the memory available now
    with EXPERTS_MARGIN to spare; else the experts are read from the file's mapping as
    stored (a file larger than the RAM still runs), and why, in one line."""
    from kestrel_cli.core.osmem import available_memory

    avail = available_memory()
    need = store.nbytes + EXPERTS_MARGIN
    if avail is None or need <= avail:
        return True, ""
    return False, (
        f"the weights ({store.nbytes / 2**30:.1f} GiB) do not fit the "
        f"{avail / 2**30:.1f} GiB of memory available: the MoE experts are read "
        f"from the file as stored (slower decode; --no-repack silences this)"
    )


def default_threads() -> int:
    """The fast cores this process may use: every allowed core when they are alike, only
    the big ones of a big.LITTLE CPU (kestrel_cli.core.cpus)."""
    return cpus.plan().threads


@dataclass(frozen=True)
class LoadOptions:
    """How to load an Engine: the library's side of the CLI's model flags, checked once
    (`validate`) for both.

    Args:
        kv_q8: store the KV cache as int8 (--kv-q8).
        kv_f16: store the KV cache as float16 (--kv-f16); not with kv_q8.
        sparse_attn: block-sparse attention (--sparse-attn) with sparse_k blocks of 32
            tokens per query head and sparse_probes keys probed per block.
        quant: None/"none", or a --quant format: quantise float weights at load.
        threads: OpenMP threads (-t); None: one per fast core this process may use
            (kestrel_cli.core.cpus: every core when they are alike, pinned to the big ones of
            a big.LITTLE CPU).
        ctx_size: context size in tokens (-c); None: the model's context length (its KV
            cache takes memory only as tokens arrive), at most ctx_cap (None: no cap).
        act: the activations quantised weights multiply (--act; docs/DESIGN.md §5 Kernels
            and ISAs): "q8" int8 blocks of 32 (the default, llama.cpp's arithmetic: the
            fast path, KL divergence from exact in docs/PERFORMANCE.md) or "f32" float32
            (exact). Float weights always take float32.
        repack: interleave q4_0 / q4_1 / q4_k / q6_k / q8_0 weights by 16 rows at load, MoE experts
            too when the weights fit the free memory (--no-repack turns it off): the decode
            GEMV's layout (pyx/gemv_x16.h), same bytes, same results up to summation order.
        sparse: the sparse options (implies sparse_attn): a `sparse.SparseSpec`, or its
            text (--sparse: a preset name or opt+opt+..., `SparseSpec.parse`, over
            sparse_k and sparse_probes).
        mmproj: a Qwen3-VL GGUF's vision tower, llama.cpp's mmproj GGUF (--mmproj); None:
            the one mmproj*.gguf beside a qwen3vl GGUF, if there is one (models/mmproj.py).
        vision_dtype: the Qwen3-VL vision tower's dtype (--vision-dtype): "f32" exact (the
            library's default), "bf16" bf16 matmuls and attention on AVX512-BF16 (refused
            on a CPU without it), "auto" bf16 where the CPU has it, else f32 (the CLI's
            default). The text model is not affected.
    """

    kv_q8: bool = False
    sparse_attn: bool = False
    sparse_k: int = 32
    sparse_probes: int = 8
    quant: str | None = None
    threads: int | None = None
    ctx_size: int | None = None
    ctx_cap: int | None = None
    act: str = "q8"
    kv_f16: bool = False
    repack: bool = True
    sparse: str | SparseSpec | None = None
    mmproj: str | os.PathLike | None = None
    vision_dtype: str = "f32"

    def sparse_spec(self) -> SparseSpec | None:
        """The sparse options these give; None: exact attention."""
        if isinstance(self.sparse, SparseSpec):
            return self.sparse
        if self.sparse is not None:
            return SparseSpec.parse(self.sparse, k=self.sparse_k, probes=self.sparse_probes)
        if self.sparse_attn:
            return SparseSpec(k=self.sparse_k, probes=self.sparse_probes)
        return None

    def validate(self) -> "LoadOptions":
        """Raise KestrelError naming the flag of the first bad value; self when all are ok."""
        if self.quant not in (None, "none", *QUANT_FORMATS):
            raise KestrelError(
                f"--quant must be one of none, {', '.join(QUANT_FORMATS)}; got {self.quant!r}"
            )
        if self.act not in ACT_MODES:
            raise KestrelError(f"--act must be one of {', '.join(ACT_MODES)}; got {self.act!r}")
        if self.ctx_size is not None and self.ctx_size < 1:
            raise KestrelError(f"-c/--ctx-size must be >= 1, got {self.ctx_size}")
        if self.ctx_size is not None and self.ctx_size > MAX_CTX:
            raise KestrelError(f"-c/--ctx-size must be at most {MAX_CTX}, got {self.ctx_size}")
        if self.ctx_cap is not None and self.ctx_cap < 1:
            raise KestrelError(f"context cap must be >= 1, got {self.ctx_cap}")
        if self.threads is not None and self.threads < 1:
            raise KestrelError(f"-t/--threads must be >= 1, got {self.threads}")
        if self.threads is not None and self.threads > thread_cap():
            raise KestrelError(
                f"-t/--threads must be at most {thread_cap()} ({thread_rule()}), got {self.threads}"
            )
        if self.kv_q8 and self.kv_f16:
            raise KestrelError("--kv-q8 and --kv-f16 exclude each other: give one")
        if self.sparse_k < 1:
            raise KestrelError(f"--sparse-k must be >= 1, got {self.sparse_k}")
        if self.sparse_probes < 1:
            raise KestrelError(f"--sparse-probes must be >= 1, got {self.sparse_probes}")
        if self.sparse is not None and not isinstance(self.sparse, (str, SparseSpec)):
            raise KestrelError(
                f"sparse options must be a SparseSpec or its text, got {type(self.sparse).__name__}"
            )
        self.sparse_spec()
        self.resolved_vision_dtype()
        return self

    def resolved_vision_dtype(self) -> str:
        """ "f32" or "bf16": vision_dtype with "auto" resolved for this CPU (KestrelError
        for an unknown value, or bf16 on a CPU without bf16 dot products)."""
        from kestrel_cli.models.qwen3_vl_vision import resolve_dtype

        return resolve_dtype(self.vision_dtype)

    @property
    def cache_spec(self) -> CacheSpec:
        """The KV cache these options describe."""
        return CacheSpec(
            "q8" if self.kv_q8 else ("f16" if self.kv_f16 else "f32"), self.sparse_spec()
        )

    def context(self, model_ctx: int | None) -> int:
        """The context size for a model whose own context length is model_ctx."""
        if self.ctx_size is not None:
            return self.ctx_size
        if self.ctx_cap is not None and (not model_ctx or model_ctx > self.ctx_cap):
            return self.ctx_cap
        return model_ctx


class VisionPrompt(list):
    """Prompt token ids (a list, so everything that takes ids takes it) with the images and
    videos behind its image and video tokens: their preprocessed pixels (`images`, both
    kinds in prompt order), the (3, T) M-RoPE positions, the rope delta after the prompt,
    and the keys the KV cache prefix is matched on (an image or video token's key names its
    input, so two of one size never share cached K/V)."""

    def __init__(
        self, ids, images, positions, rope_delta, keys, image_token_id, video_token_id=None
    ):
        super().__init__(ids)
        self.images, self.positions, self.rope_delta = images, positions, rope_delta
        self.keys, self.image_token_id = keys, image_token_id
        self.video_token_id = video_token_id

    @property
    def image_tokens(self) -> int:
        """Image and video tokens."""
        return sum(im.n_tokens for im in self.images)

    def spans(self):
        """Per image or video, in order, the (start, end) token ranges it fills: one for an
        image, one per temporal patch for a video (its frames are apart, each after its
        timestamp text)."""
        out, i = [], 0
        for im in self.images:
            video = _is_video_input(im)
            tok = self.video_token_id if video else self.image_token_id
            n = im.frame_tokens if video else im.n_tokens
            runs = []
            for _ in range(im.grid[0] if video else 1):
                while self[i] != tok:
                    i += 1
                runs.append((i, i + n))
                i += n
            out.append(runs)
        return out


def _is_video_input(im) -> bool:
    return getattr(im, "timestamps", None) is not None


IMAGE_PART_TYPES = ("image", "image_url", "input_image")
VIDEO_PART_TYPES = ("video", "video_url")


def _is_video_part(part: dict) -> bool:
    return part.get("type") in VIDEO_PART_TYPES


def _image_source(part: dict):
    """The image or video a content part names: HF {"type": "image", "image"/"url"/"path":
    X} ({"type": "video", "video": X}) or OpenAI {"type": "image_url", "image_url": {"url":
    X}} ({"type": "video_url", "video_url": {"url": X}})."""
    kind = "video" if _is_video_part(part) else "image"
    for key in (kind, "url", "path"):
        if part.get(key) is not None:
            return part[key]
    u = part.get(f"{kind}_url")
    if isinstance(u, dict):
        u = u.get("url")
    if u is None:
        raise KestrelError(f"{kind} content part without an {kind}: {sorted(part)}")
    return u


def _image_parts(messages) -> list:
    """The image and video content parts of chat messages, in order."""
    kinds = IMAGE_PART_TYPES + VIDEO_PART_TYPES
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            out += [p for p in content if isinstance(p, dict) and p.get("type") in kinds]
    return out


class Engine:
    """Load once, then `logits`, `generate` or `stream`.

    The KV cache persists between calls: a prompt that starts with the tokens already in
    the cache (a chat growing turn by turn) only prefills the new ones. `prefill` and
    `decode_step` are the two steps generation is made of (generate.py).
    """

    def __init__(
        self, model, tokenizer, config, path, store, ctx_size: int, spec: CacheSpec = CacheSpec()
    ):
        self.model, self.tokenizer, self.config, self.path = model, tokenizer, config, path
        self.store, self.ctx_size, self.spec = store, ctx_size, spec
        self.notices: list[str] = []  # one line each, for the user (load's choices)
        self.thread_plan = None  # cpus.ThreadPlan: the threads and their cores
        self.cache = self.make_cache()
        self.cached_ids: list[int] = []  # tokens whose K/V the cache holds
        self.cached_keys: list = []  # their keys (VisionPrompt.keys; ids for text)
        self.rope_delta = 0  # M-RoPE: position minus token index after them
        self.vision_ms = 0.0  # vision tower time of the last prefill
        self.image_tokens = 0  # image tokens of the last prompt
        self._vision_cache: dict = {}  # image digest -> (embeds, deepstack)
        # inference/batch.Batcher: set by a server of several slots, whose engines' model
        # calls then run in its one thread, batched (None: this thread runs them)
        self.batcher = None
        self._image_config = None
        self._video_config = None
        self.speculator = None  # speculative.Speculator: decode with a draft model (--draft)

    @property
    def threads(self) -> int:
        """The OpenMP threads the model's kernels run on (held by the model)."""
        return self.model.threads

    @classmethod
    def from_pretrained(
        cls,
        path=None,
        kv_q8: bool = False,
        sparse_attn: bool = False,
        sparse_k: int = 32,
        sparse_probes: int = 8,
        quant: str | None = None,
        threads: int | None = None,
        ctx_size: int | None = None,
        ctx_cap: int | None = None,
        act: str = "q8",
        kv_f16: bool = False,
        repack: bool = True,
        sparse: str | SparseSpec | None = None,
        mmproj: str | os.PathLike | None = None,
        vision_dtype: str = "f32",
    ) -> "Engine":
        """Load a checkpoint directory or GGUF file; None loads the bundled SmolLM2.

        Args: as `LoadOptions` (they mirror the CLI flags).
        """
        return cls.load(
            path,
            LoadOptions(
                kv_q8,
                sparse_attn,
                sparse_k,
                sparse_probes,
                quant,
                threads,
                ctx_size,
                ctx_cap,
                act,
                kv_f16,
                repack,
                sparse,
                mmproj,
                vision_dtype,
            ),
        )

    @classmethod
    def load(cls, path, options: LoadOptions) -> "Engine":
        """Load a checkpoint directory or GGUF file (None: the bundled SmolLM2)."""
        options.validate()
        # the threads and the cores they run on; pinned before the first parallel region
        plan = cpus.plan(options.threads)
        cpus.apply(plan)
        threads = plan.threads
        cfg, store, tok, p = open_checkpoint(path, options.mmproj)
        store.quantize_to(QUANT_FORMATS.get(options.quant), threads)  # --quant: at load
        store.repack_x16 = options.repack
        notices = []
        vision_file = getattr(store, "vision_file", None)
        if vision_file is not None and vision_file.note:  # which mmproj, or why none
            notices.append(vision_file.note)
        if options.repack and store.expert_nbytes:
            store.experts_at_load, why = experts_fit(store)
            if not store.experts_at_load:
                notices.append(why)
        model = resolve(cfg.model_type).Model(cfg, store, threads, act=options.act)
        if hasattr(model, "vision_dtype"):  # Qwen3-VL: its vision tower's dtype
            model.vision_dtype = options.vision_dtype
        eng = cls(
            model,
            tok,
            cfg,
            p,
            store,
            options.context(cfg.max_position_embeddings),
            options.cache_spec,
        )
        eng.notices = notices
        eng.thread_plan = plan
        return eng

    def fork(self) -> "Engine":
        """Another Engine on the same weights (shared, not copied) with its own, empty KV
        cache and timing profile; the two may run in different threads (`serve --parallel`)."""
        import copy

        model = copy.copy(self.model)  # the layers, hence the weights, are shared
        model.prof = type(self.model.prof)()  # per-call timing must not mix
        model._stack = None  # the native decode's buffers neither
        eng = Engine(
            model, self.tokenizer, self.config, self.path, self.store, self.ctx_size, self.spec
        )
        eng._model_id = getattr(self, "_model_id", None)
        if self.speculator is not None:  # the draft forked too: its own KV cache
            eng.speculator = self.speculator.fork(eng)
        return eng

    def set_draft(self, draft: "Engine | None", **settings) -> None:
        """Decode speculatively with `draft` (an Engine of a smaller model with the same
        token table; None: plain decoding again); settings: speculative.Speculator's
        (n_max, n_min, p_min). KestrelError for a draft of another vocabulary, or with
        options speculation cannot keep exact (sparse attention)."""
        from kestrel_cli.inference.speculative import Speculator

        self.speculator = None if draft is None else Speculator(self, draft, **settings)

    def make_cache(self, max_tokens: int | None = None):
        """An empty KV cache of this engine's spec (default: its context size)."""
        return self.model.make_cache(max_tokens or self.ctx_size, self.spec)

    @property
    def model_id(self) -> str:
        """What a prompt cache file names this model by (cache_file): a hash of the
        weights' names, formats, shapes and first and last bytes, the load options that
        change K and V (--quant, --act), the rope tables and the config; computed once."""
        mid = getattr(self, "_model_id", None)
        if mid is None:
            import hashlib

            h = hashlib.sha256()
            entries = getattr(self.store, "entries", {})
            for name in sorted(entries):
                fmt, raw, shape = entries[name][:3]
                a = np.asarray(raw)
                h.update(f"{name}|{fmt}|{shape}|{a.dtype}|{a.shape}|".encode())
                if a.flags.c_contiguous:  # a few bytes of each: fine-tunes differ there
                    flat = a.reshape(-1)
                    h.update(flat[:16].tobytes() + flat[-16:].tobytes())
            h.update(f"quant={getattr(self.store, 'quant', None)}|".encode())
            h.update(f"act={getattr(self.model, 'act', None)}|{self.config!r}|".encode())
            rope = getattr(self.model, "rope", None)
            for part in rope if isinstance(rope, (tuple, list)) else (rope,):
                h.update(np.asarray(part).tobytes() if part is not None else b"-")
            mid = self._model_id = h.hexdigest()
        return mid

    def save_cache(self, path, n_tokens: int | None = None) -> tuple[int, int]:
        """Write the first `n_tokens` cached tokens (all: None) and their K/V to a prompt
        cache file, atomically (runtime/cache_file.py); a prompt with images is saved up to
        its first image. Returns (tokens saved, bytes written)."""
        from kestrel_cli.runtime import cache_file

        n = len(self.cached_ids) if n_tokens is None else min(n_tokens, len(self.cached_ids))
        for i, key in enumerate(self.cached_keys[:n]):
            if not isinstance(key, int):
                n = i
                break
        return n, cache_file.save(self.cache, self.cached_ids[:n], self.model_id, path)

    def load_cache(self, path) -> tuple[int, int]:
        """Replace the KV cache with a prompt cache file's (`save_cache`): the next prompt
        reuses the longest prefix it shares with the file's tokens. A file not ours,
        truncated, or of another model or cache spec raises KestrelError before the cache
        is touched. Returns (tokens restored, bytes read)."""
        from kestrel_cli.runtime import cache_file

        cf = cache_file.open_file(path, self.cache, self.model_id)
        if cf.n_tokens and max(cf.tokens()) >= self.config.vocab_size:
            raise KestrelError(f"prompt cache {path}: token ids past the vocabulary")
        try:
            tokens = cache_file.load_into(cf, self.cache)
        except BaseException:
            self.reset()  # never half-loaded
            raise
        self.cached_ids, self.cached_keys, self.rope_delta = tokens, list(tokens), 0
        return len(tokens), cf.nbytes

    def reset(self) -> None:
        """Forget the conversation: the cache is emptied (the draft's too)."""
        self.cache.reset()
        self.cached_ids = []
        self.cached_keys = []
        self.rope_delta = 0
        if self.speculator is not None:
            self.speculator.draft.reset()

    def trim(self, n: int) -> None:
        """Keep the first `n` cached tokens (their K/V, ids and keys), drop the rest."""
        self.cache.trim(n)
        del self.cached_ids[n:], self.cached_keys[n:]

    def prefill(self, ids: list[int]) -> tuple[np.ndarray, int]:
        """Run a prompt, reusing the longest prefix the cache holds from the previous calls.

        Args:
            ids: token ids, or a VisionPrompt (encode_prompt's, for messages with images).
        Returns:
            (logits (1, V) of its last token, the number of prompt tokens reused).
        """
        if not ids:
            raise KestrelError("empty prompt")
        self._check_fits(ids)
        keys = ids.keys if isinstance(ids, VisionPrompt) else [int(t) for t in ids]
        n = 0
        # keys beyond cached_ids are stale (a caller that swapped the cache reset only the ids)
        for a, b in zip(self.cached_keys[: len(self.cached_ids)], keys):
            if a != b:
                break
            n += 1
        n = min(n, len(ids) - 1)  # at least one token to compute logits from
        self.cache.trim(n)
        self.cached_ids, self.cached_keys = self.cached_ids[:n], self.cached_keys[:n]
        logits = self._forward(ids, n, all_logits=False)
        return logits, n

    def _check_fits(self, ids) -> None:
        if min(ids) < 0 or max(ids) >= self.config.vocab_size:
            raise KestrelError(
                f"token id out of range [0, {self.config.vocab_size}): "
                f"min {min(ids)}, max {max(ids)}"
            )
        if len(ids) > self.ctx_size:
            extra = ""
            if isinstance(ids, VisionPrompt) and ids.images:
                nv = sum(map(_is_video_input, ids.images))
                what = f"{len(ids.images) - nv} image(s)" + (f", {nv} video(s)" if nv else "")
                extra = f" ({ids.image_tokens} of them for {what})"
            raise KestrelError(
                f"prompt has {len(ids)} tokens{extra}, more than the context "
                f"size {self.ctx_size} (raise -c/--ctx-size)"
            )

    def _forward(self, ids, n: int, all_logits: bool) -> np.ndarray:
        """Run ids[n:] after the n cached tokens; records ids as cached."""
        import time

        self.vision_ms, self.image_tokens = 0.0, 0
        if isinstance(ids, VisionPrompt):
            ints = [int(t) for t in ids]

            def run():
                t0 = time.perf_counter()
                vision = self._vision_input(ids, n)
                self.vision_ms = (time.perf_counter() - t0) * 1e3
                return self.model(
                    ints[n:],
                    self.cache,
                    all_logits=all_logits,
                    positions=ids.positions[:, n:],
                    vision=vision,
                )

            self.image_tokens = ids.image_tokens
            # with a batcher, the vision tower and the M-RoPE prompt run alone in its thread
            logits = run() if self.batcher is None else self.batcher.solo(self, run)
            self.cached_ids, self.cached_keys = ints, list(ids.keys)
            self.rope_delta = ids.rope_delta
        else:
            # no image in the prompt: positions are the token indices (a reused prefix
            # holds no image either: image tokens' keys never equal token ids)
            ints = [int(t) for t in ids]
            if self.batcher is None:
                logits = self.model(ints[n:], self.cache, all_logits=all_logits)
            else:  # a chunk per batch step, between the other sequences' tokens
                logits = self.batcher.run(self, ints[n:], None, all_logits)
            self.cached_ids, self.cached_keys = ints, list(ints)
            self.rope_delta = 0
        return logits

    def _vision_input(self, ids: "VisionPrompt", n: int):
        """The image rows of the tokens ids[n:], with their embeddings and deepstack
        features (the vision tower runs on the images not yet encoded)."""
        from kestrel_cli.models.qwen3_vl import VisionInput

        rows, embeds, deep = [], [], []
        for im, runs in zip(ids.images, ids.spans()):
            if runs[-1][1] <= n:
                continue
            emb, ds = self._encode_image(im)  # a video's rows: its runs one after the other
            at = np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in runs])
            keep = at >= n
            rows.append(at[keep] - n)
            embeds.append(emb[keep])
            deep.append([d[keep] for d in ds])
        if not rows:
            return None
        return VisionInput(
            np.concatenate(rows),
            np.concatenate(embeds),
            [np.concatenate(parts) for parts in zip(*deep)],
        )

    def _encode_image(self, im):
        hit = self._vision_cache.get(im.digest)
        if hit is None:
            hit = self.model.vision.encode(im.patches, [im.grid])
            if len(self._vision_cache) >= 8:
                self._vision_cache.pop(next(iter(self._vision_cache)))
            self._vision_cache[im.digest] = hit
        return hit

    def decode_step(self, token: int) -> np.ndarray:
        """Run one token after the cached ones; its logits (1, V)."""
        pos = None
        if self.rope_delta:
            pos = np.array([self.cache.offset + self.rope_delta], dtype=np.int64)
        if self.batcher is not None:  # one row of the batch's next step
            logits = self.batcher.run(self, [token], pos)
        else:
            logits = self.model([token], self.cache, positions=pos)
        self.cached_ids.append(int(token))
        self.cached_keys.append(int(token))
        return logits

    def verify(self, tokens) -> np.ndarray:
        """Run `tokens` after the cached ones in ONE forward pass (the prefill path: each
        weight is read once for all of them; one token takes decode's path); the logits of
        every row, float32 (T, V). The cache, cached_ids and cached_keys grow by them as by
        T decode_steps. Speculative decoding's verify pass (inference/speculative.py), and
        its draft's catch-up; `trim` takes back the rows not accepted."""
        ints = [int(t) for t in tokens]
        pos = None
        if self.rope_delta:  # M-RoPE after an image: positions shifted, as decode_step's
            pos = np.arange(len(ints), dtype=np.int64) + self.cache.offset + self.rope_delta
        if self.batcher is not None:  # a pass of the batch thread's, as a prompt's
            logits = self.batcher.run(self, ints, pos, all_logits=True)
        else:
            logits = self.model(ints, self.cache, all_logits=True, positions=pos)
        self.cached_ids += ints
        self.cached_keys += ints
        return logits

    # ------------------------------------------------------------------ public API
    def logits(self, token_ids) -> np.ndarray:
        """float32 [len(ids), vocab] for a fresh context (the cache is reset)."""
        ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
        if ids.size == 0:
            raise KestrelError("empty prompt")
        if ids.size > self.ctx_size:
            raise KestrelError(f"{ids.size} tokens exceed the context size {self.ctx_size}")
        if ids.min() < 0 or ids.max() >= self.config.vocab_size:
            raise KestrelError(f"token id out of range [0, {self.config.vocab_size})")
        self.reset()
        out = self.model(ids, self.cache, all_logits=True)
        self.cached_ids = [int(t) for t in ids]
        self.cached_keys = list(self.cached_ids)
        return out

    def prompt_logits(self, messages, **template_kwargs) -> np.ndarray:
        """float32 [T, vocab] for a whole chat prompt (fresh context): the chat template
        applied, images (content parts {"type": "image", "image": path or PIL image})
        preprocessed and encoded; T is the prompt's length with its image tokens."""
        ids = self.encode_prompt(list(messages), **template_kwargs)
        if not ids:
            raise KestrelError("empty prompt")
        self._check_fits(ids)
        self.reset()
        return self._forward(ids, 0, all_logits=True)

    def encode_prompt(self, prompt, limit: int | None = None, **template_kwargs) -> list[int]:
        """messages -> chat template (with images: a VisionPrompt); str -> raw text; list
        of ints (or a VisionPrompt) -> as is. With `limit`, a prompt of more text tokens
        than that raises TooManyTokens, found after tokenising about `limit` tokens of it
        (Tokenizer.encode)."""
        if isinstance(prompt, VisionPrompt):
            return prompt
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True, limit=limit)
        if (
            isinstance(prompt, (list, tuple))
            and all(isinstance(m, dict) for m in prompt)
            and prompt
        ):
            parts = _image_parts(prompt)
            if parts:
                self._check_vision()  # before a text-only template meets image parts
            # videos sized from their headers: their timestamps are prompt text
            plans = self._plan_videos([p for p in parts if _is_video_part(p)])
            text = self.tokenizer.apply_chat_template(
                list(prompt), add_generation_prompt=True, tokenize=False, **template_kwargs
            )
            if plans:
                text = self._video_text(text, plans)
            # the template writes BOS itself when it wants one
            ids = self.tokenizer.encode(text, add_special_tokens=False, limit=limit)
            return self._with_images(ids, parts, plans) if parts else ids
        ids = [int(t) for t in prompt]
        if limit is not None and len(ids) > limit:
            raise TooManyTokens(len(ids), limit, exact=True)
        if any(t < 0 or t >= self.config.vocab_size for t in ids):
            raise KestrelError(f"token id out of range [0, {self.config.vocab_size})")
        return ids

    def _check_vision(self) -> None:
        vision_file = getattr(self.store, "vision_file", None)
        if vision_file is not None and vision_file.refusal:  # a GGUF without its mmproj
            raise KestrelError(vision_file.refusal)
        if not getattr(self.model, "has_vision", False):
            raise KestrelError(
                f"{self.config.model_type} model {self.path.name} has no vision "
                f"tower: images need a Qwen3-VL checkpoint with its "
                f"model.visual.* weights"
            )

    def image_config(self):
        """The checkpoint's images.ImageConfig (preprocessor_config.json; a GGUF's: the
        Qwen3-VL processor's with its mmproj's patch sizes, mean and std), read once: with
        images.probe_image, what a caller sizes an image with (tokens_for, decode_cost,
        patch_bytes) before sending it."""
        import dataclasses

        from kestrel_cli.models.images import ImageConfig

        self._check_vision()
        if self._image_config is None:
            cfg = ImageConfig.from_dir(
                self.path if self.path.is_dir() else None, self.config.vision_config
            )
            vision_file = getattr(self.store, "vision_file", None)
            if vision_file is not None and vision_file.path is not None:
                cfg = dataclasses.replace(cfg, **vision_file.image)
                cfg.check(vision_file.path.name)
            self._image_config = cfg
        return self._image_config

    def video_config(self):
        """The checkpoint's video.VideoConfig (video_preprocessor_config.json), read once."""
        from kestrel_cli.models.video import VideoConfig

        self._check_vision()
        if self._video_config is None:
            self._video_config = VideoConfig.from_dir(
                self.path if self.path.is_dir() else None, self.config.vision_config
            )
        return self._video_config

    def _plan_videos(self, parts: list) -> list:
        """(source, video.VideoPlan) of each video part, from its header alone (the number
        of videos, each file's size, container, frame size and count are checked here)."""
        if not parts:
            return []
        from kestrel_cli.models.video import MAX_VIDEOS_PER_PROMPT, probe_video

        if self.config.video_token_id is None:
            raise KestrelError("this checkpoint's config.json has no video_token_id")
        if len(parts) > MAX_VIDEOS_PER_PROMPT:
            raise KestrelError(
                f"{len(parts)} videos in one prompt, more than {MAX_VIDEOS_PER_PROMPT}"
            )
        cfg = self.video_config()
        sources = [_image_source(p) for p in parts]
        return [(src, cfg.plan(probe_video(src))) for src in sources]

    def _token_text(self, token_id, default: str) -> str:
        text = self.tokenizer.id_to_token(token_id) if token_id is not None else None
        return text or default

    def _video_text(self, text: str, plans: list) -> str:
        """The rendered template with each video's `<|vision_start|><|video_pad|>
        <|vision_end|>` (or a bare video token) replaced by its frames' text as
        Qwen3VLProcessor writes it: per temporal patch `<t seconds>`, vision start, one
        video token (expanded to the frame's tokens after tokenising), vision end."""
        from kestrel_cli.models.video import placeholder

        cfg = self.config
        start = self._token_text(cfg.vision_start_token_id, "<|vision_start|>")
        end = self._token_text(cfg.vision_end_token_id, "<|vision_end|>")
        pad = self._token_text(cfg.video_token_id, "<|video_pad|>")
        wrapper = start + pad + end
        pieces, k, i = [], 0, 0
        while (j := text.find(pad, i)) >= 0:
            a, b = j, j + len(pad)
            if j >= len(start) and text.startswith(wrapper, j - len(start)):
                a, b = j - len(start), j - len(start) + len(wrapper)
            if k < len(plans):
                frames = "".join(placeholder(t, start, pad, end) for t in plans[k][1].timestamps)
                pieces += [text[i:a], frames]
            k, i = k + 1, b
        if k != len(plans):
            raise KestrelError(
                f"the chat template wrote {k} video token(s) for {len(plans)} video(s)"
            )
        return "".join(pieces) + text[i:]

    def _with_images(self, ids: list[int], parts: list, plans: list = ()) -> VisionPrompt:
        """The template's ids with each image token expanded to its image's tokens and each
        video token to its temporal patch's. All that needs no pixels is checked first, for
        every image and video: their number, each one's header (format, size, aspect ratio;
        a video's frame count) and the prompt's length with their tokens against the
        context; only then are they decoded and preprocessed, one at a time."""
        from kestrel_cli.models.images import MAX_IMAGES_PER_PROMPT, prepare, probe_image
        from kestrel_cli.models.qwen3_vl import rope_index

        self._check_vision()
        image_parts = [p for p in parts if not _is_video_part(p)]
        if len(image_parts) > MAX_IMAGES_PER_PROMPT:
            raise KestrelError(
                f"{len(image_parts)} images in one prompt, more than {MAX_IMAGES_PER_PROMPT}"
            )
        tok_id, vid_id = self.config.image_token_id, self.config.video_token_id
        found = sum(1 for t in ids if t == tok_id)
        if found != len(image_parts):
            raise KestrelError(
                f"the chat template wrote {found} image token(s) for {len(image_parts)} image(s)"
            )
        groups = sum(plan.grid[0] for _, plan in plans)
        if plans and sum(1 for t in ids if t == vid_id) != groups:
            raise KestrelError("the prompt's text holds video tokens of its own")
        sources = [_image_source(p) for p in image_parts]
        n_image = 0
        if image_parts:
            cfg = self.image_config()
            n_image = sum(cfg.tokens_for(h.width, h.height) for h in map(probe_image, sources))
        n_video = sum(plan.n_tokens for _, plan in plans)
        total = len(ids) - len(image_parts) + n_image - groups + n_video
        if total > self.ctx_size:
            what = [f"{n_image} of them for {len(image_parts)} image(s)"] if image_parts else []
            what += [f"{n_video} for {len(plans)} video(s)"] if plans else []
            raise KestrelError(
                f"prompt has {total} tokens ({', '.join(what)}), more than the context size "
                f"{self.ctx_size} (raise -c/--ctx-size)"
            )
        images = [prepare(src, cfg) for src in sources]
        if plans:
            from kestrel_cli.models.video import prepare_video

            vcfg = self.video_config()
            videos = [prepare_video(src, vcfg, plan) for src, plan in plans]
        out, keys, grids, media = [], [], [], []
        k = v = g = 0  # next image, next video, temporal patch of that video
        for t in ids:
            if t == tok_id:
                im = images[k]
                out += [tok_id] * im.n_tokens
                keys += [(im.digest, j) for j in range(im.n_tokens)]
                _, gh, gw = im.grid
                grids.append((1, gh // im.merge, gw // im.merge))
                media.append(im)
                k += 1
            elif plans and t == vid_id:
                vi = videos[v]
                n = vi.frame_tokens
                out += [vid_id] * n
                keys += [(vi.digest, g * n + j) for j in range(n)]
                _, gh, gw = vi.grid
                grids.append((1, gh // vi.merge, gw // vi.merge))
                if g == 0:
                    media.append(vi)
                g += 1
                if g == vi.grid[0]:
                    v, g = v + 1, 0
            else:
                out.append(t)
                keys.append(t)
        vision_ids = {tok_id} | ({vid_id} if plans else set())
        positions, delta = rope_index(out, vision_ids, grids)
        return VisionPrompt(out, media, positions, delta, keys, tok_id, vid_id)

    def stream(
        self,
        prompt,
        max_tokens: int = 256,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        repeat_penalty: float = 1.0,
        seed: int | None = None,
        stop=(),
        template_kwargs: dict | None = None,
        ignore_eos: bool = False,
        logit_bias: dict[int, float] | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logprobs: int | None = None,
        json_schema: dict | None = None,
        json_then: str = "",
        reasoning_budget: int | None = None,
    ) -> Iterator[Chunk]:
        """Chunks with text, per-token timing and, last, finish_reason and Stats
        (logprobs=k: each token's log-probability and the k likeliest, on its chunk;
        json_schema: the answer is one JSON value matching it, enforced while sampling;
        reasoning_budget: at most that many tokens inside a <think> block, then it is
        closed (text/think_budget.py); None or -1 unlimited, 0 no thinking (messages are
        rendered with enable_thinking false unless template_kwargs say otherwise). With a
        json_schema the budget is not used: the grammar rules the whole answer.)"""
        if max_tokens < 0:
            raise KestrelError(f"max_tokens must be >= 0, got {max_tokens}")
        check_params(temperature, top_k, top_p, min_p, repeat_penalty)
        think_budget.check_budget(reasoning_budget)
        template_kwargs = dict(template_kwargs or {})
        if reasoning_budget == 0:
            template_kwargs.setdefault("enable_thinking", False)
        ids = self.encode_prompt(prompt, **template_kwargs)
        steps = None
        if self.speculator is not None:
            steps = self.speculator.steps(ids)  # refuses what it cannot do (images)
        sampler = make_sampler(temperature, top_k, top_p, min_p, seed)
        stop = [stop] if isinstance(stop, str) else list(stop or [])
        if logit_bias and any(not 0 <= int(t) < self.config.vocab_size for t in logit_bias):
            raise KestrelError(f"logit_bias: token id out of range [0, {self.config.vocab_size})")
        constraint = None
        if json_schema is not None:
            from kestrel_cli.text.constrained import JsonConstraint

            constraint = JsonConstraint(self, json_schema, json_then)
        # the grammar already decides every token (JSON from the first one): a budget
        # forcing </think> inside it would leave no token allowed
        budget = (
            None
            if constraint is not None
            else think_budget.make(self.tokenizer, reasoning_budget, ids)
        )
        return stream_generate(
            self,
            ids,
            max_tokens,
            sampler,
            repeat_penalty=repeat_penalty,
            stop=stop,
            stop_ids=[] if ignore_eos else None,
            logit_bias=logit_bias,
            presence_penalty=presence_penalty,
            frequency_penalty=frequency_penalty,
            logprobs=logprobs,
            constraint=constraint,
            processors=[] if budget is None else [budget],
            steps=steps,
        )

    def generate(
        self, prompt, max_tokens: int = 256, temperature: float = 0.0, **kw
    ) -> Iterator[str]:
        """Text pieces as they are produced (greedy when temperature == 0).

        Args:
            prompt: list of {"role", "content"} (chat template), str (raw) or token ids.
        Yields:
            str pieces; joined they are the reply.
        """
        for chunk in self.stream(prompt, max_tokens, temperature, **kw):
            if chunk.text:
                yield chunk.text
