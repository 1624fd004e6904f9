"""The tokenizer built from GGUF metadata vs transformers' GGUF tokenizer and SentencePiece itself."""

from __future__ import annotations

import io
import unicodedata

import pytest
from gguf_util import V, write_gguf

from quill.default_model import default_model_path
from quill.errors import CheckpointError, UnsupportedFormatError
from quill.formats.gguf.file import GGUFFile
from quill.formats.gguf.tokenizer import tokenizer_spec_from_gguf

CORPUS = [
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "I'm sure you've heard they'll say it's what we'd do. DON'T SHOUT, it's RUDE'S",
    "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)  # slow\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", a[i] >> 2); }\n\t\t// tabs\r\n",
    "Numbers: 3.14159, 2024-11-21, 1,000,000, 12345678901234567890 and ½ ² ③ ٣٤.",
    "   leading spaces, trailing   \n\n\n   multiple\r\nlines\t\ttabs  ",
    "x" * 40 + " " * 17 + "y\u00a0z\u2003w\u3000v",
    "Unicode: café naïve Ωμέγα Привет 日本語のテキスト 한국어 العربية हिन्दी",
    "Emoji 😀🎉👍🏽 👨‍👩‍👧 ✨ and symbols ©®™ ∑∫√ → ⇒",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|><repo_name>quill<file_sep>main.py<|im_start|> <|im_end|>text<|im_start|>",
    "", " ", "\n", "  \n ",
]


@pytest.fixture(scope="module")
def smollm():
    path = default_model_path()
    f = GGUFFile(path)
    return f, tokenizer_spec_from_gguf(f.metadata, path)


@pytest.fixture(scope="module")
def hf_smollm():
    from transformers import AutoTokenizer

    path = default_model_path()
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def _has_number(text: str) -> bool:
    return any(unicodedata.category(c).startswith("N") for c in text)


def test_ids_and_decoding_equal_transformers(smollm, hf_smollm):
    """Exactly transformers' GGUF tokenizer on text without numbers.

    With numbers they part: transformers does not know tokenizer.ggml.pre 'smollm' and falls back to
    GPT-2's split (` ?\\p{N}+`), while llama.cpp splits every \\p{N} on its own first, as the original
    SmolLM2 tokenizer.json does (Digits(individual_digits) before ByteLevel): see the next test.
    """
    _, spec = smollm
    tok = spec.tokenizer
    assert tok.get_vocab_size() == len(hf_smollm) == 49152
    for text in CORPUS:
        ids = tok.encode(text, add_special_tokens=False).ids
        if not _has_number(text):
            assert ids == hf_smollm.encode(text, add_special_tokens=False), text
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert tok.decode(ids, skip_special_tokens=False) == hf_smollm.decode(ids)


def test_a_long_text_encodes_to_the_same_ids(smollm):
    """quill.Tokenizer encodes texts of LONG_TEXT characters and more through the batch call (the GIL
    released for servers): the ids are the plain call's, BOS included."""
    from quill.tokenizer import LONG_TEXT, Tokenizer

    _, spec = smollm
    text = " ".join(CORPUS) * (LONG_TEXT // len(" ".join(CORPUS)) + 1)
    assert len(text) >= LONG_TEXT
    want = spec.tokenizer.encode(text, add_special_tokens=False).ids
    tok = Tokenizer(spec)
    bos = [spec.bos_token_id] if spec.add_bos_token and spec.bos_token_id is not None else []
    assert tok.encode(text) == bos + want
    assert tok.encode(text, add_special_tokens=False) == want


def test_numbers_equal_transformers_with_smollms_own_pre_tokenizer(smollm, hf_smollm):
    """transformers' vocabulary and merges, with the pre-tokenizer of SmolLM2's tokenizer.json."""
    from tokenizers import Tokenizer, pre_tokenizers

    oracle = Tokenizer.from_str(hf_smollm.backend_tokenizer.to_str())
    oracle.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)])
    _, spec = smollm
    numbers = [t for t in CORPUS if _has_number(t)] + ["x² + y² = 10²", "Ⅻ ⅔ 𝟙𝟚 ⁴²", " 1 22 333 4444"]
    for text in numbers:
        ids = spec.tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == oracle.encode(text, add_special_tokens=False).ids, text
    diverged = [t for t in numbers if spec.tokenizer.encode(t, add_special_tokens=False).ids
                != hf_smollm.encode(t, add_special_tokens=False)]
    assert diverged  # the corpus does reach the case where transformers' fallback differs


def test_special_tokens_are_never_split(smollm):
    f, spec = smollm
    tokens, types = f.metadata["tokenizer.ggml.tokens"], f.metadata["tokenizer.ggml.token_type"]
    control = [(i, t) for i, (t, k) in enumerate(zip(tokens, types)) if k == 3]
    assert len(control) == 17
    for i, t in control:
        assert spec.tokenizer.encode(f"a{t}b", add_special_tokens=False).ids[1] == i
        assert spec.tokenizer.token_to_id(t) == i
    assert spec.tokenizer.decode([1, 2], skip_special_tokens=True) == ""


def test_digits_are_split_one_by_one(smollm):
    """tokenizer.ggml.pre 'smollm' splits every \\p{N} first (llama.cpp LLAMA_VOCAB_PRE_TYPE_SMOLLM)."""
    _, spec = smollm
    enc = spec.tokenizer.encode("year 2024", add_special_tokens=False)
    assert enc.tokens[-4:] == ["2", "0", "2", "4"]


def test_spec_fields(smollm):
    f, spec = smollm
    assert spec.bos_token_id == 1 and spec.pad_token_id == 2 and spec.add_bos_token is False
    assert spec.eos_token_ids == (2, 0)  # eos <|im_end|>, then <|endoftext|> (an end-of-generation text)
    assert spec.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>",
                                   "unk_token": "<|endoftext|>", "pad_token": "<|im_end|>"}
    assert spec.chat_template == f.metadata["tokenizer.chat_template"]


def test_chat_template_renders_like_transformers(smollm, hf_smollm):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    _, spec = smollm
    messages = [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."},
                {"role": "user", "content": "And ünïcode 😀?"}]
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    text = env.from_string(spec.chat_template).render(messages=messages, add_generation_prompt=True,
                                                      **spec.special_tokens)
    assert text == hf_smollm.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    ids = spec.tokenizer.encode(text, add_special_tokens=False).ids
    assert ids == hf_smollm.encode(text, add_special_tokens=False)
    assert ids.count(1) == 5 and ids.count(2) == 4  # <|im_start|> / <|im_end|> kept whole


def _copy_tokenizer(f: GGUFFile, path, pre: str):
    keys = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type")
    kv = [("tokenizer.ggml.model", "gpt2", V.STRING), ("tokenizer.ggml.pre", pre, V.STRING),
          ("tokenizer.ggml.bos_token_id", 1, V.UINT32), ("tokenizer.ggml.eos_token_id", 2, V.UINT32)]
    kv += [(k, f.metadata[k], V.ARRAY, V.INT32 if k.endswith("type") else V.STRING) for k in keys]
    return write_gguf(path, "llama", kv)


@pytest.mark.parametrize("pre", ["qwen2", "gpt-2"])
def test_other_pre_tokenizers_equal_transformers(smollm, tmp_path, pre):
    """The SmolLM vocabulary under other pre-tokenizers that transformers also implements."""
    from transformers import AutoTokenizer

    f, _ = smollm
    path = _copy_tokenizer(f, tmp_path / f"{pre}.gguf", pre)
    hf = AutoTokenizer.from_pretrained(tmp_path, gguf_file=path.name)
    g = GGUFFile(path)
    tok = tokenizer_spec_from_gguf(g.metadata, path).tokenizer
    for text in CORPUS:
        assert tok.encode(text, add_special_tokens=False).ids == hf.encode(text, add_special_tokens=False), text


def test_llama_bpe_pre_tokenizer_groups_digits_by_three(smollm, tmp_path):
    f, _ = smollm
    path = _copy_tokenizer(f, tmp_path / "l3.gguf", "llama-bpe")
    spec = tokenizer_spec_from_gguf(GGUFFile(path).metadata, path)
    pieces = spec.tokenizer.pre_tokenizer.pre_tokenize_str("I'M 1234567 ok\n\nyes")
    assert [p for p, _ in pieces] == ["I", "'M", "Ġ", "123", "456", "7", "Ġok", "ĊĊ", "yes"]
    assert spec.add_bos_token is True  # llama.cpp's default for llama3-style vocabularies


# ---- SentencePiece ("llama") vocabularies -------------------------------------------------

SPM_TEXT = [
    "Hello world, this is a test of the tokenizer.", "  two leading spaces", "trailing  ", "",
    "def f(x):\n    return 42\n", "naïve café 日本 😀 ünïcödé ǅ", "a\tb\n\nc", "12345 numbers 3.14",
    "The quick brown fox jumps over the lazy dog again and again.",
]


@pytest.fixture(scope="module")
def spm(tmp_path_factory):
    """A SentencePiece BPE model trained here, written to GGUF the way convert_hf_to_gguf writes one."""
    import sentencepiece as sp

    lines = [line for line in open(__file__, encoding="utf-8").read().splitlines() if line.strip()] * 3
    model = io.BytesIO()
    sp.SentencePieceTrainer.train(
        sentence_iterator=iter(lines), model_writer=model, vocab_size=500, model_type="bpe", byte_fallback=True,
        normalization_rule_name="identity", remove_extra_whitespaces=False, add_dummy_prefix=True,
        user_defined_symbols=["<tool>"], minloglevel=2)
    proc = sp.SentencePieceProcessor(model_proto=model.getvalue())
    n = proc.vocab_size()
    types = [2 if proc.is_unknown(i) else 3 if proc.is_control(i) else 6 if proc.is_byte(i)
             else 4 if proc.id_to_piece(i) == "<tool>" else 1 for i in range(n)]
    kv = [("tokenizer.ggml.model", "llama", V.STRING),
          ("tokenizer.ggml.tokens", [proc.id_to_piece(i) for i in range(n)], V.ARRAY, V.STRING),
          ("tokenizer.ggml.scores", [proc.get_score(i) for i in range(n)], V.ARRAY, V.FLOAT32),
          ("tokenizer.ggml.token_type", types, V.ARRAY, V.INT32),
          ("tokenizer.ggml.bos_token_id", proc.bos_id(), V.UINT32),
          ("tokenizer.ggml.eos_token_id", proc.eos_id(), V.UINT32),
          ("tokenizer.ggml.unknown_token_id", proc.unk_id(), V.UINT32)]
    path = write_gguf(tmp_path_factory.mktemp("spm") / "spm.gguf", "llama", kv)
    return proc, tokenizer_spec_from_gguf(GGUFFile(path).metadata, path), lines


def test_sentencepiece_ids_equal_sentencepiece(spm):
    proc, spec, lines = spm
    assert spec.add_bos_token is True and spec.bos_token_id == proc.bos_id()
    # Text holding the user-defined <tool> follows llama.cpp, not SentencePiece: see the next test.
    for text in SPM_TEXT + [line for line in lines[:200] if "<tool>" not in line]:
        ids = spec.tokenizer.encode(text, add_special_tokens=False).ids
        assert ids == proc.encode(text), text
        assert spec.tokenizer.decode(ids) == proc.decode(ids)


def test_sentencepiece_space_prefix_after_special_tokens_follows_llama_cpp(spm):
    """llama.cpp prefixes a space to every text run that follows a special token (is_prev_special)."""
    proc, spec, _ = spm
    tool = proc.piece_to_id("<tool>")
    ids = spec.tokenizer.encode("<tool> call", add_special_tokens=False).ids
    assert ids == [tool] + proc.encode(" call")  # SentencePiece's own dummy prefix stands in for llama.cpp's


def test_unsupported_tokenizers(tmp_path):
    path = write_gguf(tmp_path / "b.gguf", "llama", [("tokenizer.ggml.model", "bert", V.STRING),
                                                     ("tokenizer.ggml.tokens", ["a", "b"], V.ARRAY, V.STRING)])
    with pytest.raises(UnsupportedFormatError,
                       match="tokenizer.ggml.model 'bert' is not supported; supported: gemma4, gpt2, llama"):
        tokenizer_spec_from_gguf(GGUFFile(path).metadata, path)
    kv = [("tokenizer.ggml.model", "gpt2", V.STRING), ("tokenizer.ggml.pre", "martian", V.STRING),
          ("tokenizer.ggml.tokens", ["a", "b"], V.ARRAY, V.STRING),
          ("tokenizer.ggml.merges", ["a b"], V.ARRAY, V.STRING)]
    path = write_gguf(tmp_path / "p.gguf", "llama", kv)
    with pytest.raises(UnsupportedFormatError, match="pre 'martian' is not supported; supported: .*smollm"):
        tokenizer_spec_from_gguf(GGUFFile(path).metadata, path)
    path = write_gguf(tmp_path / "n.gguf", "llama", [("tokenizer.ggml.model", "gpt2", V.STRING)])
    with pytest.raises(CheckpointError, match="tokenizer.ggml.tokens' should be a non-empty array of strings"):
        tokenizer_spec_from_gguf(GGUFFile(path).metadata, path)
