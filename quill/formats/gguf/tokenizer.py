"""A ready ``tokenizers.Tokenizer`` from GGUF tokenizer metadata (``tokenizer.ggml.*``).

Three vocabulary kinds, as llama.cpp reads them (``src/llama-vocab.cpp``):

* ``gpt2``: byte-level BPE.  Tokens are stored in GPT-2's byte alphabet with an
  explicit merge list; how text is split into words before BPE depends on
  ``tokenizer.ggml.pre``: llama.cpp applies a sequence of regexes, each one
  splitting the pieces the previous one produced (keeping unmatched text as
  pieces too), which is exactly a sequence of ``Split(..., "isolated")``.
* ``llama``: SentencePiece BPE with byte fallback.  Only per-token scores are
  stored; merges are rebuilt from them (a piece merges from two pieces that
  spell it, ranked by the merged piece's score).
* ``gemma4``: BPE over U+2581-escaped text with the stored merges and byte
  fallback, text split only at newlines (Gemma 4's tokenizer.json as it is).

Tokens typed CONTROL (3) and USER_DEFINED (4) are matched whole in text, never
split (llama.cpp's ``tokenizer_st_partition``): they become added tokens.
The tokenizer adds no BOS/EOS itself; ``TokenizerSpec.add_bos_token`` says
whether the caller should.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from quill.errors import CheckpointError, UnsupportedFormatError, format_choices
from quill.tokenizer_spec import TokenizerSpec

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def _family(names: str, regexes: Sequence[str], ignore_merges: bool = False, add_bos: bool = False) -> dict:
    return {n: (tuple(regexes), ignore_merges, add_bos) for n in names.split()}


# tokenizer.ggml.pre -> (split regexes in order, BPE ignore_merges, llama.cpp's add_bos default),
# grouped as llama.cpp's llm_tokenizer_bpe groups LLAMA_VOCAB_PRE_TYPE_*.
PRE_TOKENIZERS: dict[str, tuple[tuple[str, ...], bool, bool]] = {
    **_family("default", (r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    **_family("llama3 llama-v3 llama-bpe falcon3 falcon-h1 pixtral midm-2.0 lfm2 dbrx smaug-bpe",
              (_LLAMA3,), ignore_merges=True, add_bos=True),
    **_family("falcon", (r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    **_family("starcoder refact command-r smollm codeshell exaone minerva-7b mellum2", (r"\p{N}", _GPT2)),
    **_family("gpt-2 phi-2 mpt olmo jais trillion granite-docling exaone4 roberta-bpe", (_GPT2,)),
    **_family("qwen2 deepseek-r1-qwen stablelm2 megrez hunyuan kormo f2llmv2", (_QWEN2,)),
    **_family("tekken", (_TEKKEN,), ignore_merges=True, add_bos=True),
    **_family("gpt-4o llama4 kanana2 minimax-m2", (_GPT4O,)),
}
# llama.cpp recognizes these texts as end-of-generation tokens even when no id key names them.
EOG_TEXTS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<end_of_turn>", "<|endoftext|>",
             "<|eom_id|>", "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>")


def tokenizer_spec_from_gguf(meta: dict, path) -> TokenizerSpec:
    """Build the tokenizer a GGUF file describes; typed errors name the metadata key."""
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        raise CheckpointError(f"{path}: no tokenizer in the file (tokenizer.ggml.model is missing)")
    tokens = _string_list(meta, "tokenizer.ggml.tokens", path)
    types = _token_types(meta, len(tokens), path)
    if kind == "gpt2":
        tokenizer, default_bos = _byte_level(meta, tokens, path)
    elif kind == "llama":
        tokenizer, default_bos = _sentencepiece(meta, tokens, types, path), True
    elif kind == "gemma4":
        tokenizer, default_bos = _gemma4(meta, tokens, path), True  # llama.cpp forces add_bos for it
    else:
        raise UnsupportedFormatError(
            f"{path}: tokenizer.ggml.model '{kind}' is not supported; supported: gemma4, gpt2, llama")
    _add_special_tokens(tokenizer, tokens, types)
    ids = {k: _token_id(meta, k, len(tokens), path) for k in ("bos", "eos", "eot", "eom", "unknown", "padding")}
    eog = [i for i in (ids["eos"], ids["eot"], ids["eom"]) if i is not None]
    eog += [i for i, t in enumerate(tokens) if t in EOG_TEXTS and types[i] in (CONTROL, USER_DEFINED)]
    return TokenizerSpec(
        tokenizer=tokenizer,
        bos_token_id=ids["bos"],
        eos_token_ids=tuple(dict.fromkeys(eog)),
        pad_token_id=ids["padding"],
        add_bos_token=bool(meta.get("tokenizer.ggml.add_bos_token", default_bos)),
        chat_template=meta.get("tokenizer.chat_template"),
        special_tokens={name: tokens[ids[key]] for name, key in (
            ("bos_token", "bos"), ("eos_token", "eos"), ("unk_token", "unknown"), ("pad_token", "padding"))
            if ids[key] is not None},
    )


# ---- metadata checks -------------------------------------------------------------

def _string_list(meta: dict, key: str, path) -> list[str]:
    v = meta.get(key)
    if not isinstance(v, list) or not v or not all(isinstance(t, str) for t in v):
        raise CheckpointError(f"{path}: GGUF metadata '{key}' should be a non-empty array of strings")
    return v


def _token_types(meta: dict, n: int, path) -> list[int]:
    types = meta.get("tokenizer.ggml.token_type")
    if types is None:
        return [NORMAL] * n
    if not isinstance(types, list) or len(types) < n or not all(isinstance(t, int) for t in types[:n]):
        raise CheckpointError(f"{path}: tokenizer.ggml.token_type should be an int array of at least {n} entries")
    return types[:n]


def _token_id(meta: dict, name: str, n_tokens: int, path) -> int | None:
    key = f"tokenizer.ggml.{name}_token_id"
    v = meta.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < n_tokens:
        raise CheckpointError(f"{path}: {key} = {v!r} is not a token id (vocabulary of {n_tokens})")
    return v


# ---- builders ------------------------------------------------------------------

def _byte_level(meta: dict, tokens: list[str], path):
    pre = meta.get("tokenizer.ggml.pre") or "default"
    if pre not in PRE_TOKENIZERS:
        raise UnsupportedFormatError(
            f"{path}: tokenizer.ggml.pre '{pre}' is not supported; supported: {format_choices(PRE_TOKENIZERS)}")
    regexes, ignore_merges, add_bos = PRE_TOKENIZERS[pre]
    vocab = _vocab(tokens)
    merges = [_split_merge(m, path) for m in _string_list(meta, "tokenizer.ggml.merges", path)]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, ignore_merges=ignore_merges))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer, add_bos


def _sentencepiece(meta: dict, tokens: list[str], types: list[int], path):
    scores = meta.get("tokenizer.ggml.scores")
    if not isinstance(scores, list) or len(scores) < len(tokens):
        raise CheckpointError(f"{path}: tokenizer.ggml.scores should hold one score per token ({len(tokens)})")
    vocab = _vocab(tokens)
    unk = _token_id(meta, "unknown", len(tokens), path)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=_merges_from_scores(tokens, types, scores, vocab),
                                     unk_token=None if unk is None else tokens[unk],
                                     fuse_unk=True, byte_fallback=True))
    # llama.cpp (like SentencePiece) prepends one space to every run of text that starts the input or
    # follows a special token, then escapes spaces as U+2581; tokenizers' Metaspace would skip the
    # prefix on text already starting with a space, so this is a normalizer instead.
    prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True))
    steps = [normalizers.Prepend("\u2581")] if prefix else []
    tokenizer.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", "\u2581")])
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _gemma4(meta: dict, tokens: list[str], path):
    """Gemma 4's SentencePiece-style BPE (llama.cpp's LLAMA_VOCAB_PRE_TYPE_GEMMA4): spaces escaped as U+2581
    with no prefix space, the stored merges run over each run of non-newline text (runs of newlines apart),
    characters outside the vocabulary as their <0xNN> byte tokens."""
    merges = [_split_merge(m, path) for m in _string_list(meta, "tokenizer.ggml.merges", path)]
    tokenizer = Tokenizer(models.BPE(vocab=_vocab(tokens), merges=merges, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", "\u2581")
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[^\n]+|[\n]+"), behavior="isolated")
    tokenizer.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    return tokenizer


def _vocab(tokens: list[str]) -> dict[str, int]:
    vocab: dict[str, int] = {}
    for i, t in enumerate(tokens):
        vocab.setdefault(t, i)  # llama.cpp rejects duplicates; keep the first id like its token_to_id would
    return vocab


def _split_merge(merge: str, path) -> tuple[str, str]:
    # llama.cpp splits at the first space after position 0; a token may itself start with a space.
    pos = merge.find(" ", 1)
    if pos < 0:
        raise CheckpointError(f"{path}: tokenizer.ggml.merges entry {merge!r} is not two tokens separated by a space")
    return merge[:pos], merge[pos + 1:]


def _merges_from_scores(tokens: list[str], types: list[int], scores: list[float],
                        vocab: dict[str, int]) -> list[tuple[str, str]]:
    """SentencePiece BPE as merges: ``(left, right)`` for every piece spelled by two pieces, best score first.

    Control, byte and unused pieces are never the result of a merge in SentencePiece.
    Ties are broken as transformers' ``generate_merges`` breaks them: longer left part first, then
    longer right part, then the merged piece's id, then the parts' ids.
    """
    found = []
    for i, piece in enumerate(tokens):
        if types[i] in (CONTROL, BYTE, UNUSED, UNKNOWN) or vocab.get(piece) != i:
            continue
        for k in range(1, len(piece)):
            left, right = piece[:k], piece[k:]
            if left in vocab and right in vocab:
                found.append((-scores[i], -len(left), -len(right), i, vocab[left], vocab[right], left, right))
    found.sort()
    return [(f[6], f[7]) for f in found]


def _add_special_tokens(tokenizer, tokens: list[str], types: list[int]) -> None:
    """CONTROL tokens as special, USER_DEFINED as plain added tokens: both matched whole, never split."""
    control = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == CONTROL]
    user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == USER_DEFINED]
    if control:
        tokenizer.add_special_tokens(control)
    if user:
        tokenizer.add_tokens(user)
