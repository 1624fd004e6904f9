"""Text <-> token ids, chat templates and streaming detokenization, over a ``TokenizerSpec``.

HF directories build their spec here (:func:`hf_tokenizer_spec`: tokenizer.json,
tokenizer_config.json, generation_config.json); GGUF files build theirs from
their metadata.  Either way this class is what generation sees.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from quill.chat_tools import template_messages
from quill.errors import CheckpointError, GenerationError
from quill.tokenizer_spec import TokenizerSpec

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


# Texts from this many characters are encoded with the GIL released, so a server that tokenizes on a
# worker thread keeps its event loop running (a 2.4 MB prompt held it 3.3 s; released: 0.1 s at most).
# Shorter ones take the plain call: a batch call marks tokenizers' thread pool used, and a process that
# forks after that prints a warning in the child.
LONG_TEXT = 1 << 16


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special-token facts and chat template of one model."""

    def __init__(self, spec: TokenizerSpec):
        self.spec = spec
        self._tok = spec.tokenizer
        self._template = None

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self.spec.eos_token_ids

    @property
    def bos_token_id(self) -> int | None:
        return self.spec.bos_token_id

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.spec.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; BOS is prepended when the model expects it and ``add_special_tokens``."""
        if len(text) < LONG_TEXT:
            ids = self._tok.encode(text, add_special_tokens=False).ids
        else:  # the same ids; encode_batch releases the GIL, encode holds it (~1.5 s per MB here)
            ids = self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        bos = self.spec.bos_token_id
        if add_special_tokens and self.spec.add_bos_token and bos is not None and (not ids or ids[0] != bos):
            ids = [bos] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            template_kwargs: Mapping[str, Any] | None = None) -> str:
        """Render a conversation ([{"role": ..., "content": ...}, ...]) with the model's jinja2 template;
        ``tools`` (OpenAI function tools) and tool calls in the history as ``quill.chat_tools`` passes them;
        ``template_kwargs``: more variables for the template, as transformers' ``apply_chat_template(**kwargs)``
        takes them (``enable_thinking=False`` for Qwen3's)."""
        clash = sorted(set(template_kwargs or ()) & TEMPLATE_OWN_VARIABLES)
        if clash:
            raise GenerationError(f"chat_template_kwargs: {', '.join(clash)} cannot be set there (they are the "
                                  "request's own fields)")
        if not self.spec.chat_template:
            raise GenerationError("this model's tokenizer has no chat template; pass a plain prompt instead")
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise_template_error
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            try:
                self._template = env.from_string(self.spec.chat_template)
            except jinja2.TemplateError as e:
                raise GenerationError(f"the model's chat template does not parse: {e}") from None
        messages, tools = template_messages(messages, tools, self.spec.chat_template)
        try:
            return self._template.render(**{**self.spec.special_tokens, **(template_kwargs or {})}, messages=messages,
                                         tools=tools, add_generation_prompt=add_generation_prompt)
        except jinja2.TemplateError as e:
            raise GenerationError(f"the model's chat template failed on these messages: {e}") from None

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """Token ids of a conversation rendered with the chat template (which writes its own special tokens)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, template_kwargs),
                           add_special_tokens=False)

    def detokenizer(self, context: Sequence[int] = (), skip_special_tokens: bool = True) -> "IncrementalDetokenizer":
        return IncrementalDetokenizer(self, context, skip_special_tokens)


# what apply_chat_template passes itself: chat_template_kwargs may not replace these
TEMPLATE_OWN_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt"})


def _tojson(value, indent=None, ensure_ascii=False):
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii)


def _raise_template_error(message: str):
    raise GenerationError(f"chat template: {message}")


class IncrementalDetokenizer:
    """Turns a stream of token ids into text pieces, never splitting a multi-byte character.

    Text is decoded over a short window of earlier tokens (so leading-space
    rules of the tokenizer apply as in a full decode), and a piece is released
    only once it no longer ends in an incomplete UTF-8 sequence (U+FFFD).
    """

    def __init__(self, tokenizer: Tokenizer, context: Sequence[int] = (), skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(context[-4:])
        self.prefix = 0  # start of the decode window
        self.read = len(self.ids)  # tokens before this are already released as text

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_id: int) -> str:
        """Append one token; return the newly completed text (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self.prefix, self.read = self.read, len(self.ids)
            return text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the very end)."""
        prefix_text = self._decode(self.ids[self.prefix:self.read])
        text = self._decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(prefix_text):]


# ---- building a spec from an HF directory ------------------------------------

def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: should be a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _ids(value: Any) -> list[int]:
    if isinstance(value, bool) or value is None:
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def _chat_template(directory: Path, tcfg: Mapping[str, Any]) -> str | None:
    template = tcfg.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if not template and (directory / "chat_template.jinja").is_file():
        template = (directory / "chat_template.jinja").read_text()
    if not template:
        template = _read_json(directory / "chat_template.json").get("chat_template")
    return template if isinstance(template, str) and template else None


def eos_token_ids(directory: Path | None, config: Mapping[str, Any], extra: Sequence[int] = ()) -> tuple[int, ...]:
    """EOS ids from generation_config.json, config.json and ``extra``, in that order, without repeats."""
    gen = _read_json(directory / "generation_config.json") if directory is not None else {}
    ids = _ids(gen.get("eos_token_id")) + _ids(config.get("eos_token_id")) + list(extra)
    return tuple(dict.fromkeys(ids))


def hf_tokenizer_spec(directory: str | Path, config: Mapping[str, Any]) -> TokenizerSpec:
    """The tokenizer of an HF checkpoint directory (tokenizer.json is required)."""
    from tokenizers import Tokenizer as HFTokenizer
    directory = Path(directory)
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise CheckpointError(f"{directory}: no tokenizer.json (quill reads the fast-tokenizer file); "
                              "pass token-id prompts with skip_tokenizer_init=True instead")
    try:
        tok = HFTokenizer.from_file(str(path))
    except Exception as e:  # the tokenizers library raises bare Exception on malformed files
        raise CheckpointError(f"{path}: cannot be read as a tokenizer ({e})") from None
    tcfg = _read_json(directory / "tokenizer_config.json")
    specials = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(tcfg.get(k))) is not None}
    ids = {k: tok.token_to_id(t) for k, t in specials.items()}
    bos = ids.get("bos_token")
    if bos is None:
        bos = next(iter(_ids(config.get("bos_token_id"))), None)
    add_bos = tcfg.get("add_bos_token")
    if not isinstance(add_bos, bool):  # else: does tokenizer.json's own post-processor add it?
        probe = tok.encode("a", add_special_tokens=True).ids
        add_bos = bos is not None and bool(probe) and probe[0] == bos
    eos = [ids["eos_token"]] if ids.get("eos_token") is not None else []
    return TokenizerSpec(
        tokenizer=tok, bos_token_id=bos, eos_token_ids=eos_token_ids(directory, config, eos),
        pad_token_id=ids.get("pad_token"), add_bos_token=add_bos,
        chat_template=_chat_template(directory, tcfg), special_tokens=specials,
    )
