"""`kestrel quantize`: a Hugging Face checkpoint directory to one GGUF file, as llama.cpp's
convert_hf_to_gguf.py followed by llama-quantize would write it, streamed tensor by tensor.

Layout (what llama.cpp expects):
- arch `llama` (Llama, Mistral), `qwen2`, `qwen3`, `qwen3moe` or `qwen3vl` (Qwen3-VL's text
  decoder, with its M-RoPE sections; the vision tower is not written: llama.cpp keeps it in
  a separate mmproj file);
  tensor names from the gguf package's map; MoE experts stacked into one ffn_*_exps tensor;
  the llama arch's q/k rows permuted as the converter does (each head's two rotary halves
  interleaved), biases included.
- metadata: the hyperparameters, RoPE (linear scaling as keys; Llama 3 scaling as the
  `rope_freqs` tensor of per-frequency divisors), general.file_type.
- tokenizer: byte-level BPE only (tokenizer.ggml.model gpt2): every id below the model's
  vocab_size (ids with no token: `[PADn]`, unused), token types (special or `<|..|>` added
  tokens: control; other added tokens: user-defined), tokenizer.ggml.pre from the
  pre-tokenizer's split (gpt-2, qwen2, llama-bpe, smollm, tekken), and merges, special ids,
  add-bos/eos flags and chat template through the gguf package's SpecialVocab.
- tensor types: those llama-quantize picks for the file type (`tensor_types`): 1-D tensors,
  norms and MoE routers F32; Q4_K_M / Q5_K_M give attn_v and ffn_down Q6_K on llama.cpp's
  "more bits" layers; output (and token_embd when tied) Q6_K in every quantised type but
  q8_0; rows not whole blocks fall back (Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0, then F16).
  `pure=True` (llama-quantize --pure): every matrix in the file type's own type.
- quantisers: gguf.quants for the 32-blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1: llama.cpp's bytes,
  rounding included), kquants for Q4_K, Q5_K, Q6_K.

Memory stays bounded whatever the model size: the header and tensor infos are written first
(sizes follow from shapes and types), then each tensor is read from the memory-mapped
safetensors a chunk of rows at a time, quantised, written, and its pages dropped. The file is
written to OUT.part and renamed at the end; a failed or interrupted run removes the .part.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import re
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator

import numpy as np

from kestrel_cli.core.atomic import atomic_write
from kestrel_cli.core.errors import KestrelError, clip
from kestrel_cli.formats.config import Config

# llama.cpp's arch per config.json model_type
GGUF_ARCH = {
    "llama": "LLAMA",
    "mistral": "LLAMA",
    "qwen2": "QWEN2",
    "qwen3": "QWEN3",
    "qwen3_vl": "QWEN3VL",
    "qwen3_moe": "QWEN3MOE",
}
# type name -> (general.file_type, the type of most matrices)
FILE_TYPES = {
    "f32": ("ALL_F32", "F32"),
    "f16": ("MOSTLY_F16", "F16"),
    "bf16": ("MOSTLY_BF16", "BF16"),
    "q8_0": ("MOSTLY_Q8_0", "Q8_0"),
    "q4_0": ("MOSTLY_Q4_0", "Q4_0"),
    "q4_1": ("MOSTLY_Q4_1", "Q4_1"),
    "q4_k_m": ("MOSTLY_Q4_K_M", "Q4_K"),
    "q5_k_m": ("MOSTLY_Q5_K_M", "Q5_K"),
    "q6_k": ("MOSTLY_Q6_K", "Q6_K"),
}
QUANT_TYPES = ("q8_0", "q4_0", "q4_1", "q4_k_m", "q5_k_m", "q6_k")  # `kestrel quantize`
_FALLBACK = {"Q4_K": "Q5_0", "Q5_K": "Q5_1", "Q6_K": "Q8_0"}  # rows not whole 256s
CHUNK_VALUES = 1 << 22  # source values converted and quantised at a time (16 MiB f32)
WORK_BYTES = 1 << 30  # the quantisers' scratch across threads (~60 B a value, K-quants)


# ------------------------------------------------------------------------------ the plan


@dataclass
class PlanTensor:
    """One GGUF tensor: its name, numpy-order shape and the checkpoint tensors it stacks."""

    name: str
    shape: tuple[int, ...]
    parts: list[tuple[str, tuple[int, ...]]]
    permute_heads: int | None = None  # llama q/k: heads whose rows interleave
    qtype: str = "F32"  # a gguf.GGMLQuantizationType name
    nbytes: int = 0
    data: np.ndarray | None = field(default=None, repr=False)  # generated (rope_freqs)


def as_config(config) -> Config:
    """A Config from a Config or a config.json dict (KestrelError naming what is wrong)."""
    if isinstance(config, Config):
        return config
    try:
        return Config.from_hf(config)
    except TypeError as e:
        raise KestrelError(f"config.json: a value of the wrong type ({e})") from None


def gguf_arch(cfg: Config) -> str:
    """The GGUF architecture name (llama, qwen2, qwen3, qwen3moe, qwen3vl) of a model_type."""
    import gguf

    if cfg.model_type not in GGUF_ARCH:
        raise KestrelError(
            f"model_type {cfg.model_type!r} cannot be written as GGUF; supported: "
            f"{', '.join(sorted(GGUF_ARCH))}"
        )
    return gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH[GGUF_ARCH[cfg.model_type]]]


def _is_moe_layer(cfg: Config, i: int) -> bool:
    return (
        bool(cfg.num_experts)
        and i not in cfg.mlp_only_layers
        and (i + 1) % cfg.decoder_sparse_step == 0
    )


def decoder_tensors(config, present: Iterable[str] = ()) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of a checkpoint's text decoder, in GGUF order, as the checkpoint names
    them (`model.language_model.*` for Qwen3-VL). Biases are listed when `present` names them.

    Within an MoE layer the experts come all gate_proj first, then up_proj, then down_proj, so
    each merged ffn_*_exps tensor is a run of consecutive entries."""
    cfg = as_config(config)
    present = set(present)
    H, I, V = cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    p = "model.language_model" if cfg.model_type == "qwen3_vl" else "model"
    out: list[tuple[str, tuple[int, ...]]] = []

    def add(name, shape):
        out.append((name, shape))
        bias = name[: -len(".weight")] + ".bias"
        if bias in present:
            out.append((bias, shape[:1]))

    add(f"{p}.embed_tokens.weight", (V, H))
    for i in range(cfg.num_hidden_layers):
        q = f"{p}.layers.{i}"
        add(f"{q}.input_layernorm.weight", (H,))
        add(f"{q}.self_attn.q_proj.weight", (nh * hd, H))
        add(f"{q}.self_attn.k_proj.weight", (nkv * hd, H))
        add(f"{q}.self_attn.v_proj.weight", (nkv * hd, H))
        add(f"{q}.self_attn.o_proj.weight", (H, nh * hd))
        if cfg.model_type in ("qwen3", "qwen3_moe", "qwen3_vl"):
            add(f"{q}.self_attn.q_norm.weight", (hd,))
            add(f"{q}.self_attn.k_norm.weight", (hd,))
        add(f"{q}.post_attention_layernorm.weight", (H,))
        if _is_moe_layer(cfg, i):
            E, Im = cfg.num_experts, cfg.moe_intermediate_size
            add(f"{q}.mlp.gate.weight", (E, H))
            for proj, shape in (
                ("gate_proj", (Im, H)),
                ("up_proj", (Im, H)),
                ("down_proj", (H, Im)),
            ):
                for e in range(E):
                    add(f"{q}.mlp.experts.{e}.{proj}.weight", shape)
        else:
            add(f"{q}.mlp.gate_proj.weight", (I, H))
            add(f"{q}.mlp.up_proj.weight", (I, H))
            add(f"{q}.mlp.down_proj.weight", (H, I))
    add(f"{p}.norm.weight", (H,))
    if not cfg.tie_word_embeddings:
        add("lm_head.weight", (V, H))
    return out


def gguf_plan(config, tensors) -> list[tuple[str, tuple[int, ...], list]]:
    """[(GGUF name, numpy shape, [(checkpoint name, shape), ...])] in `tensors` order: names
    from the gguf package's map for the arch, consecutive experts merged into one tensor."""
    import gguf

    cfg = as_config(config)
    arch = gguf.MODEL_ARCH[GGUF_ARCH[cfg.model_type]] if cfg.model_type in GGUF_ARCH else None
    if arch is None:
        gguf_arch(cfg)  # raises, naming the supported types
    dense = [i for i in range(cfg.num_hidden_layers) if not _is_moe_layer(cfg, i)]
    if cfg.num_experts and dense:
        raise KestrelError(
            f"layer(s) {dense[:4]} of this {cfg.model_type} are dense MLPs "
            f"(mlp_only_layers / decoder_sparse_step): llama.cpp's "
            f"{gguf.MODEL_ARCH_NAMES[arch]} has experts in every layer"
        )
    names = gguf.get_tensor_name_map(arch, cfg.num_hidden_layers)
    plan: list = []
    for name, shape in tensors:
        hf = re.sub(r"^model\.language_model\.", "model.", name)
        hf = re.sub(r"\.experts\.\d+\.", ".experts.", hf)
        g = names.get_name(hf, try_suffixes=(".weight", ".bias"))
        if g is None:
            raise KestrelError(f"{name}: no GGUF name for arch {gguf.MODEL_ARCH_NAMES[arch]}")
        if plan and plan[-1][0] == g:
            plan[-1][2].append((name, shape))
        else:
            plan.append((g, shape, [(name, shape)]))
    return [
        (g, (len(parts), *shape) if len(parts) > 1 else shape, parts) for g, shape, parts in plan
    ]


def permutation(rows: int, n_head: int) -> np.ndarray:
    """The row order of convert_hf_to_gguf's llama q/k permute: GGUF row r holds checkpoint
    row perm[r] (within each head, the two rotary halves' rows interleaved)."""
    half = rows // n_head // 2
    return np.arange(rows).reshape(n_head, 2, half).swapaxes(1, 2).reshape(rows)


# ---------------------------------------------------------------------- tensor types


def _more_bits(i_layer: int, n_layers: int) -> bool:
    """llama-quantize's use_more_bits: the first and last eighth, and every third between."""
    return (
        i_layer < n_layers // 8
        or i_layer >= 7 * n_layers // 8
        or (i_layer - n_layers // 8) % 3 == 2
    )


def _fallback(qtype: str, ncols: int) -> str:
    """llama-quantize's type for rows that are not whole blocks of `qtype`."""
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    if ncols % block == 0:
        return qtype
    qtype = _FALLBACK.get(qtype, qtype)
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    return qtype if ncols % block == 0 else "F16"


def tensor_types(cfg: Config, names_shapes, ftype: str, pure: bool = False) -> list[str]:
    """The GGML type of each (GGUF name, shape), as llama-quantize picks it for `ftype`
    (convert_hf_to_gguf for f32/f16/bf16); `pure`: every matrix in the ftype's type."""
    default = FILE_TYPES[ftype][1]
    quantised = ftype not in ("f32", "f16", "bf16")
    names_shapes = list(names_shapes)
    tied = not any(n == "output.weight" for n, _ in names_shapes)
    n_layers = cfg.num_hidden_layers
    n_attn_v = sum(".attn_v.weight" in n for n, _ in names_shapes)
    n_expert = cfg.num_experts
    i_attn_v = 0
    out = []
    for name, shape in names_shapes:
        if (
            len(shape) < 2
            or name.endswith("_norm.weight")
            or ".ffn_gate_inp." in name
            or not name.endswith(".weight")
        ):
            out.append("F32")
            continue
        t = default
        if quantised and not pure:
            m = re.match(r"blk\.(\d+)\.", name)
            layer = int(m.group(1)) if m else 0
            if name == "output.weight" or (tied and name == "token_embd.weight"):
                t = _output_type(ftype, default, shape[-1])
            elif ".attn_v." in name:
                if ftype in ("q4_k_m", "q5_k_m") and _more_bits(i_attn_v, n_attn_v):
                    t = "Q6_K"
                if (
                    cfg.model_type in ("llama", "mistral")
                    and n_layers == 80
                    and cfg.num_key_value_heads != cfg.num_attention_heads
                    and t in ("Q3_K", "Q4_K")
                ):
                    t = "Q5_K"  # llama.cpp's 70B rule: attn_v is 8x smaller
                if n_expert == 8:
                    t = "Q8_0"
                i_attn_v += 1
            elif ".attn_k." in name and n_expert == 8:
                t = "Q8_0"
            elif ".ffn_down" in name:
                if ftype in ("q4_k_m", "q5_k_m") and _more_bits(layer, n_layers):
                    t = "Q6_K"
            elif ".attn_output." in name and n_expert == 8 and ftype == "q4_k_m":
                t = "Q5_K"
        if quantised:
            t = _fallback(t, shape[-1])
        out.append(t)
    return out


def _output_type(ftype: str, default: str, ncols: int) -> str:
    """output.weight (token_embd when tied): Q6_K unless the file is q8_0 (llama-quantize)."""
    import gguf

    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[default]][0]
    if ncols % block:
        return "Q8_0"
    return default if default == "Q8_0" else "Q6_K"


def type_nbytes(qtype: str, shape) -> int:
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    if shape[-1] % block:
        raise KestrelError(f"rows of {shape[-1]} are not whole {qtype} blocks of {block}")
    return math.prod(shape) // block * size


def quantize_rows(x: np.ndarray, qtype: str) -> np.ndarray:
    """float32 rows (r, n) -> the bytes (or values) of `qtype`, llama.cpp's quantisers."""
    import gguf
    from gguf.quants import quantize

    if qtype in ("Q4_K", "Q5_K", "Q6_K"):
        from kestrel_cli.formats.kquants import QUANTIZERS

        return QUANTIZERS[qtype.lower()](x)
    return quantize(np.ascontiguousarray(x, dtype=np.float32), gguf.GGMLQuantizationType[qtype])


# ------------------------------------------------------------------------------ tokenizer

_PRE_BY_SPLIT = None


def _pre_name(pre: dict | None, where: str) -> str:
    """tokenizer.ggml.pre for a tokenizer.json pre_tokenizer (byte-level BPE only)."""
    global _PRE_BY_SPLIT
    if _PRE_BY_SPLIT is None:
        from kestrel_cli.text import tokenizer as T

        _PRE_BY_SPLIT = {
            T._LLAMA3_SPLIT: "llama-bpe",
            T._QWEN2_SPLIT: "qwen2",
            T._TEKKEN_SPLIT: "tekken",
        }
    steps = (pre or {}).get("pretokenizers") if (pre or {}).get("type") == "Sequence" else [pre]
    kinds = [s.get("type") if isinstance(s, dict) else None for s in steps or []]
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if (
        kinds == ["Digits", "ByteLevel"]
        and steps[0].get("individual_digits")
        and steps[1].get("use_regex", True)
    ):
        return "smollm"
    if kinds == ["Split", "ByteLevel"] and not steps[1].get("use_regex", True):
        regex = (steps[0].get("pattern") or {}).get("Regex")
        if regex in _PRE_BY_SPLIT and str(steps[0].get("behavior")).lower() == "isolated":
            return _PRE_BY_SPLIT[regex]
    raise KestrelError(
        f"{where}: pre-tokenizer {clip(json.dumps(kinds), 120)} not recognised "
        f"(supported: "
        f"GPT-2 byte-level, and the Qwen2, Llama 3, SmolLM and Tekken splits)"
    )


def _looks_special(token: str) -> bool:
    return (token.startswith("<|") and token.endswith("|>")) or (
        token.startswith("<｜") and token.endswith("｜>")
    )


def token_list(tok, vocab_size: int, where: str = "tokenizer") -> tuple[list[str], list[int]]:
    """(tokens, token types) of a `tokenizers.Tokenizer` padded to `vocab_size`: ids without
    a token become `[PADn]` (unused); added tokens are control (special, or spelled <|..|>)
    or user-defined; the rest normal (as convert_hf_to_gguf's byte-level BPE vocabulary)."""
    import gguf

    by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
    if by_id and max(by_id) >= vocab_size:
        raise KestrelError(
            f"{where}: token id {max(by_id)} is past the model's vocab_size {vocab_size}"
        )
    added = tok.get_added_tokens_decoder()
    tokens, types = [], []
    for i in range(vocab_size):
        t = by_id.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
            continue
        if i in added:
            if added[i].special or _looks_special(t):
                types.append(gguf.TokenType.CONTROL)
            else:
                t = t.replace("\u2581", " ")
                types.append(gguf.TokenType.USER_DEFINED)
        else:
            types.append(gguf.TokenType.NORMAL)
        tokens.append(t)
    return tokens, [int(x) for x in types]


def add_tokenizer_from_dir(w, path: Path, vocab_size: int) -> None:
    """Write a checkpoint directory's byte-level BPE tokenizer into GGUF writer `w`."""
    import gguf
    from tokenizers import Tokenizer as _Tok

    from kestrel_cli.models.loader import confine_model_files

    confine_model_files(path)  # no file read through a link out of `path`
    tok_file = path / "tokenizer.json"
    if not tok_file.is_file():
        raise KestrelError(f"{tok_file}: not found (a Hugging Face tokenizer.json is required)")
    try:
        raw = json.loads(tok_file.read_text(encoding="utf-8"))
        tok = _Tok.from_str(json.dumps(raw))
    except Exception as e:  # JSON or the Rust side: one line
        raise KestrelError(
            f"{tok_file}: corrupt tokenizer.json ({' '.join(str(e).split())[:200]})"
        ) from None
    model = raw.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise KestrelError(
            f"{tok_file}: only byte-level BPE tokenizers can be written (this is "
            f"{model.get('type')}{' with byte fallback' if model.get('byte_fallback') else ''})"
        )
    pre = _pre_name(raw.get("pre_tokenizer"), str(tok_file))
    tokens, types = token_list(tok, vocab_size, str(tok_file))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    quiet = logging.getLogger("gguf")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # SpecialVocab warns about ids past the vocab
    try:
        special = gguf.SpecialVocab(path, load_merges=True, n_vocab=vocab_size)
    except (ValueError, OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KestrelError(f"{path}: tokenizer files unreadable ({clip(e, 200)})") from None
    finally:
        quiet.setLevel(level)
    if not special.merges:
        raise KestrelError(f"{tok_file}: the BPE model has no merges")
    jinja = path / "chat_template.jinja"
    if jinja.is_file():  # transformers: the file wins over the config
        special.chat_template = jinja.read_text(encoding="utf-8")
    special.add_to_gguf(w, quiet=True)


# ------------------------------------------------------------------------------- metadata


def add_hparams(
    w,
    cfg: Config,
    name: str,
    ftype: str,
    plan: list[PlanTensor] | None = None,
    deepstack_layers: int = 0,
) -> None:
    """The model metadata convert_hf_to_gguf writes (KestrelError for RoPE it cannot say);
    with the `plan`, general.type and the size label (e.g. 1.7B, 128x3.3B for MoE) too.
    rope.dimension_count, vocab_size and key/value_length are written for every arch (the
    converter: for llama, and key lengths when config.json names head_dim); llama.cpp
    reads the same values either way."""
    import gguf

    w.add_name(name)
    if plan is not None:
        total = sum(math.prod(t.shape) for t in plan if t.data is None)
        experts = sum(math.prod(t.shape) for t in plan if "_exps." in t.name)
        E = cfg.num_experts
        w.add_type("model")
        w.add_size_label(gguf.size_label(total, total - experts, experts // E if E else 0, E))
    w.add_file_type(gguf.LlamaFileType[FILE_TYPES[ftype][0]])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_rope_dimension_count(cfg.head_dim)
    rope = cfg.rope
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if rope["rope_type"] == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(rope["factor"]))
    elif rope["rope_type"] == "yarn":
        if any(rope.get(k) for k in ("attention_factor", "mscale", "mscale_all_dim")) or (
            rope.get("truncate", True) is not True
        ):
            raise KestrelError(
                "yarn with attention_factor, mscale or truncate cannot be written as GGUF"
            )
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        if rope.get("beta_fast"):
            w.add_rope_scaling_yarn_beta_fast(float(rope["beta_fast"]))
        if rope.get("beta_slow"):
            w.add_rope_scaling_yarn_beta_slow(float(rope["beta_slow"]))
    elif rope["rope_type"] not in ("default", "llama3"):  # llama3: the rope_freqs tensor
        raise KestrelError(f"rope_type {rope['rope_type']!r} cannot be written as GGUF")
    if rope.get("mrope_section"):  # qwen3vl: [t, h, w] padded to 4
        w.add_rope_dimension_sections((list(rope["mrope_section"]) + [0] * 4)[:4])
    if cfg.model_type == "qwen3_vl":
        w.add_num_deepstack_layers(deepstack_layers)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    if cfg.num_experts:
        w.add_expert_count(cfg.num_experts)
        w.add_expert_used_count(cfg.num_experts_per_tok)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)


def rope_freqs(cfg: Config) -> np.ndarray | None:
    """Llama 3 RoPE scaling as llama.cpp reads it: each frequency's divisor (f32, head_dim/2)."""
    if cfg.rope["rope_type"] != "llama3":
        return None
    scaled, _ = cfg.rope_inv_freq()
    base = np.float32(cfg.rope["rope_theta"])
    dim = cfg.head_dim
    plain = np.float32(1) / base ** (np.arange(0, dim, 2).astype(np.float32) / np.float32(dim))
    return (plain / scaled).astype(np.float32)


# -------------------------------------------------------------------------------- writing

RowSource = Callable[[str, tuple[int, ...], "np.ndarray | None"], Iterator[np.ndarray]]


def chunk_values(threads: int) -> int:
    """Source values per chunk: CHUNK_VALUES, less with many threads (bounded scratch)."""
    return max(1 << 16, min(CHUNK_VALUES, WORK_BYTES // 64 // max(1, threads)))


def write_gguf(
    path: Path,
    cfg: Config,
    plan: list[PlanTensor],
    rows: RowSource,
    add_metadata: Callable,
    progress: Callable[[PlanTensor, int], None] | None = None,
    threads: int = 1,
    arch: str | None = None,
) -> int:
    """Write one GGUF file: metadata (`add_metadata(writer)`), the tensor infos of `plan`,
    then each tensor's data, quantised a chunk of rows at a time. `rows(name, shape, order)`
    yields a checkpoint tensor's float32 rows in chunks (`order`: the rows' order, or None).
    With threads > 1 up to 2*threads chunks are quantised at once (NumPy releases the GIL),
    written in order. `path`: a file name, or a binary file open for writing (closed at
    the end); the file is fsynced once complete. `arch`: general.architecture (default:
    the model's, gguf_arch; "clip" for an mmproj). Returns the bytes of tensor data written."""
    import collections
    from concurrent.futures import ThreadPoolExecutor

    import gguf

    given = None if isinstance(path, (str, os.PathLike)) else path  # an open file
    w = gguf.GGUFWriter(path if given is None else None, arch or gguf_arch(cfg))
    pool = ThreadPoolExecutor(threads) if threads > 1 else None
    try:
        add_metadata(w)
        for t in plan:
            raw = gguf.GGMLQuantizationType[t.qtype]
            t.nbytes = type_nbytes(t.qtype, t.shape)
            w.add_tensor_info(t.name, t.shape, np.dtype(np.float32), t.nbytes, raw_dtype=raw)
        if given is not None:  # the caller's file, as the writer's own open() would set it
            w.fout, w.state = [given], gguf.gguf_writer.WriterState.EMPTY  # (it follows links)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        f = w.fout[0]
        total = 0
        for t in plan:
            w.write_padding(f, f.tell())
            start = f.tell()
            if t.data is not None:
                f.write(quantize_rows(t.data.reshape(1, -1), t.qtype).tobytes())
            pending: collections.deque = collections.deque()

            def drain(keep: int):
                while len(pending) > keep:
                    fut, n = pending.popleft()
                    f.write((fut.result() if pool else fut).tobytes())
                    if progress is not None:
                        progress(t, n)

            for name, shape in t.parts:
                order = permutation(shape[0], t.permute_heads) if t.permute_heads else None
                for x in rows(name, shape, order):
                    pending.append(
                        (
                            pool.submit(quantize_rows, x, t.qtype)
                            if pool
                            else quantize_rows(x, t.qtype),
                            x.size,
                        )
                    )
                    drain(2 * threads - 1)
            drain(0)
            if f.tell() - start != t.nbytes:
                raise KestrelError(f"{t.name}: wrote {f.tell() - start} bytes, expected {t.nbytes}")
            total += t.nbytes
        w.write_padding(f, f.tell())
        f.flush()
        os.fsync(f.fileno())  # on disk before the caller gives it its name
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        w.close()
    return total


def build_plan(cfg: Config, tensors, ftype: str, pure: bool = False) -> list[PlanTensor]:
    """The PlanTensors of checkpoint `tensors` ([(name, shape)]) for file type `ftype`."""
    arch = gguf_arch(cfg)
    plan = [PlanTensor(g, shape, parts) for g, shape, parts in gguf_plan(cfg, tensors)]
    freqs = rope_freqs(cfg)
    if freqs is not None:
        plan.insert(0, PlanTensor("rope_freqs.weight", freqs.shape, [], data=freqs))
    if arch == "llama":
        for t in plan:
            kind = t.name.split(".")[-2] if t.name.startswith("blk.") else ""
            if kind in ("attn_q", "attn_k"):
                t.permute_heads = (
                    cfg.num_attention_heads if kind == "attn_q" else cfg.num_key_value_heads
                )
    for t, q in zip(plan, tensor_types(cfg, [(t.name, t.shape) for t in plan], ftype, pure)):
        t.qtype = q
    return plan


# ------------------------------------------------------------------ from a checkpoint dir

_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^model\.visual\.|^visual\.|^mtp\.")


def _store_rows(store, chunk_values: int):
    """A RowSource over a loader TensorStore (memory-mapped safetensors)."""
    from kestrel_cli.core.osmem import drop_pages
    from kestrel_cli.formats.weights import Weight

    def rows(name, shape, order):
        fmt, raw, _, _ = store.entries[name]
        if len(shape) == 1:
            v = Weight(fmt, raw.reshape(1, -1), (1, shape[0])).dequantize()
            yield v if order is None else v[:, order]
            return
        d, n = shape
        step = max(1, chunk_values // n)
        for r0 in range(0, d, step):
            idx = slice(r0, min(d, r0 + step)) if order is None else order[r0 : r0 + step]
            src = raw[idx]
            yield Weight(fmt, src, (src.shape[0], n)).dequantize()
            if order is None:
                drop_pages(src)
        drop_pages(raw)

    return rows


def _checked_tensors(cfg: Config, store, path: Path) -> list[tuple[str, tuple[int, ...]]]:
    """The decoder's tensors, each checked against the checkpoint (missing, shape, dtype);
    tensors the GGUF would silently lose are refused."""
    names = set(store.entries)
    tensors = decoder_tensors(cfg, names)
    want = {n for n, _ in tensors}
    for name, shape in tensors:
        store._get(name, shape)  # KestrelError: missing, shape, dtype
    extra = sorted(
        n
        for n in names - want
        if not _IGNORED.search(n) and not (n == "lm_head.weight" and cfg.tie_word_embeddings)
    )
    if extra:
        more = f" (and {len(extra) - 3} more)" if len(extra) > 3 else ""
        raise KestrelError(
            f"{path}: tensor(s) {', '.join(clip(n) for n in extra[:3])}{more} "
            f"have no place in a "
            f"{gguf_arch(cfg)} GGUF; not supported"
        )
    return tensors


def _progress_bar(plan: list[PlanTensor], enabled: bool):
    """(callback, context manager): a rich bar on stderr of the GGUF bytes written and the
    tensor being written (n of N, name, type)."""
    import contextlib

    if not enabled:
        return None, contextlib.nullcontext()
    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    for t in plan:
        t.nbytes = type_nbytes(t.qtype, t.shape)
    bar = Progress(
        TextColumn("quantising"),
        BarColumn(),
        DownloadColumn(binary_units=True),
        TimeRemainingColumn(),
        TextColumn("{task.fields[tensor]}"),
        console=Console(stderr=True),
    )
    task = bar.add_task("quantising", total=sum(t.nbytes for t in plan), tensor="")
    index = {t.name: i for i, t in enumerate(plan, 1)}

    def update(t: PlanTensor, values: int):
        bar.update(
            task,
            advance=values * t.nbytes / math.prod(t.shape),
            tensor=f"tensor {index[t.name]}/{len(plan)} {t.name} {t.qtype}",
        )

    return update, bar


class Terminated(KestrelError):
    """SIGTERM while writing (the CLI may exit 143 on it, as a process killed by it would)."""


@contextlib.contextmanager
def _sigterm_raises(out: Path):
    """SIGTERM (`kill`, a service manager) ends the write as Ctrl-C does: an exception at
    the current Python line, so OUT.part is removed and the CLI prints one line; a second
    SIGTERM meanwhile is ignored (the cleanup is short). Main thread only (Python runs
    signal handlers there); the previous handler is back afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise Terminated(f"terminated (SIGTERM): {out} not written")

    old = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


def quantize_checkpoint(
    src,
    out,
    ftype: str,
    pure: bool = False,
    progress: bool = False,
    log: Callable[[str], None] | None = None,
    threads: int | None = None,
) -> dict:
    """Write Hugging Face checkpoint directory `src` as GGUF file `out` of type `ftype`
    (QUANT_TYPES, or f32/f16/bf16) with `threads` quantising (default: the cores).
    Returns a summary dict (types, bytes, tensors)."""
    from kestrel_cli.inference.engine import default_threads
    from kestrel_cli.models.loader import _load_hf_dir, config_of

    src, out = Path(src).expanduser(), Path(out).expanduser()
    if ftype not in FILE_TYPES:
        raise KestrelError(f"unknown type {ftype!r} (choose from {', '.join(QUANT_TYPES)})")
    if not src.exists():
        raise KestrelError(f"{src} does not exist")
    if not src.is_dir():
        raise KestrelError(
            f"{src}: expected a Hugging Face checkpoint directory (config.json, "
            f"*.safetensors, tokenizer.json)"
        )
    if out.is_dir():
        raise KestrelError(f"{out} is a directory; give the .gguf file to write")
    if not out.parent.is_dir():
        raise KestrelError(f"{out.parent}: no such directory")
    threads = default_threads() if threads is None else threads
    if threads < 1:
        raise KestrelError(f"threads must be >= 1, got {threads}")
    raw, store, _tok = _load_hf_dir(src)
    cfg = config_of(raw, src / "config.json")
    gguf_arch(cfg)
    tensors = _checked_tensors(cfg, store, src)
    plan = build_plan(cfg, tensors, ftype, pure)

    def metadata(w):
        vision = raw.get("vision_config") or {}
        add_hparams(
            w,
            cfg,
            src.resolve().name,
            ftype,
            plan,
            len(vision.get("deepstack_visual_indexes") or []),
        )
        add_tokenizer_from_dir(w, src, cfg.vocab_size)

    update, bar = _progress_bar(plan, progress)
    with _sigterm_raises(out), atomic_write(out) as f, bar:
        total = write_gguf(
            f,
            cfg,
            plan,
            _store_rows(store, chunk_values(threads)),
            metadata,
            update,
            threads,
        )
    return export_summary(out, plan, ftype, total, gguf_arch(cfg), log, arch=gguf_arch(cfg))


def export_summary(out: Path, plan, ftype: str, total: int, what: str, log, **extra) -> dict:
    """The summary `kestrel quantize` prints and returns for a written file: its tensor types
    counted, its size; `what` names the file's kind in the log line, extra keys go after
    "path"."""
    types: dict[str, int] = {}
    for t in plan:
        types[t.qtype] = types.get(t.qtype, 0) + 1
    summary = {
        "path": str(out),
        **extra,
        "ftype": ftype,
        "tensors": len(plan),
        "types": types,
        "bytes": out.stat().st_size,
        "tensor_bytes": total,
    }
    if log is not None:
        log(
            f"{out}: {what} {ftype}, {len(plan)} tensors "
            f"({', '.join(f'{k} x{v}' for k, v in sorted(types.items()))}), "
            f"{summary['bytes'] / 2**20:.1f} MiB"
        )
    return summary
