"""Reasoning split from the answer for thinking models: ``reasoning_content`` beside ``content``.

``qwen3``        Qwen3 / QwQ: ``<think>...</think>`` then the answer; without ``<think>`` the text is all
                 answer -- unless the prompt opened the thought itself (Qwen3-Thinking, QwQ templates end
                 their generation prompt with ``<think>``), when everything up to ``</think>`` is reasoning.
``deepseek_r1``  DeepSeek-R1 and its distills: the same markers; the answer always starts in thought
                 (R1's template opens it, and the model may or may not repeat ``<think>``).

``--reasoning-parser auto`` (the default) picks ``qwen3`` for chat templates that know ``</think>`` (they
strip old thoughts from the history: the thinking families) and none for the others, so a model that
never thinks gets its ``<think>``-looking text back untouched.
"""

from __future__ import annotations

from dataclasses import dataclass

from quill.errors import ConfigError
from quill.serving.tool_parsers import _held_back

START, END = "<think>", "</think>"


@dataclass
class Split:
    reasoning: str | None  # None: no thought at all
    content: str


class ReasoningParser:
    name = "qwen3"
    always_opened = False  # the answer starts in thought whatever the prompt says

    def opened_by(self, prompt: str) -> bool:
        """Whether a rendered prompt leaves the answer inside a thought."""
        return self.always_opened or prompt.rstrip().endswith(START)

    def split(self, text: str, opened: bool, final: bool) -> Split:
        """Reasoning and answer of ``text`` (the answer so far unless ``final``: a marker's beginning is held)."""
        lead, opened = text.lstrip(), opened or self.always_opened
        if lead.startswith(START):
            text, opened = lead[len(START):], True
        elif not opened:
            if not final and START.startswith(lead):
                return Split(None, "")  # maybe "<thi..."
            return Split(None, text)
        end = text.find(END)
        if end < 0:
            return Split(text if final else _held_back(text, END), "")
        return Split(text[:end], text[end + len(END):].lstrip())  # the blank line after </think> is no answer


class DeepSeekR1Parser(ReasoningParser):
    name = "deepseek_r1"
    always_opened = True


PARSERS: dict[str, type[ReasoningParser]] = {p.name: p for p in (ReasoningParser, DeepSeekR1Parser)}


def reasoning_parser(name: str | None, template: str | None) -> ReasoningParser | None:
    """The parser ``name`` (``auto``: by the chat template; ``none``/None: no split)."""
    if name in (None, "none"):
        return None
    if name == "auto":
        return ReasoningParser() if template and END in template else None
    try:
        return PARSERS[name]()
    except KeyError:
        raise ConfigError(f"--reasoning-parser: unknown parser '{name}'; known: auto, none, "
                          f"{', '.join(PARSERS)}") from None
