"""One answer's text as reasoning, content and tool calls: whole, or as stream events.

A stream re-reads the answer generated so far at each piece (``ToolParser.parse`` and
``ReasoningParser.split`` hold back what may still change) and sends what grew: reasoning and
content text, a call's id and name once its name is whole, then its argument text as it comes.
The pieces therefore always add up to what the whole answer reads as.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from quill.serving.reasoning import ReasoningParser, Split
from quill.serving.tool_parsers import Parsed, ToolCall, ToolParser


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Event:
    kind: str  # "reasoning", "content", "call" (index, id, name), "args" (index, text)
    text: str = ""
    index: int = 0
    id: str = ""
    name: str = ""


@dataclass
class Answer:
    reasoning: str | None
    content: str
    calls: list[tuple[str, ToolCall]]  # (id, call)


@dataclass
class OutputParser:
    """``tools``: read tool calls (None: the text is all content); ``reasoning``: split thoughts off;
    ``opened``: the prompt left the answer inside a thought; ``prefix``: text the prompt already wrote
    of the answer (a required call's opening), read as its beginning; ``suffix``: text that closes the
    answer once it is complete (the end of a call whose arguments were held to their schema)."""

    tools: ToolParser | None = None
    reasoning: ReasoningParser | None = None
    opened: bool = False
    prefix: str = ""
    suffix: str = ""
    text: str = ""
    _sent: dict = field(default_factory=lambda: {"reasoning": "", "content": ""})
    _calls: list = field(default_factory=list)  # [id, name, arguments sent]

    def __post_init__(self):
        self.text = self.prefix

    def read(self, text: str, final: bool = True) -> Answer:
        """The answer ``text`` (the prompt's prefix not included) as a whole."""
        split, parsed = self._parse(self.prefix + text + (self.suffix if final else ""), final)
        return Answer(split.reasoning, parsed.content, [(call_id(), c) for c in parsed.calls])

    def _parse(self, text: str, final: bool) -> tuple[Split, Parsed]:
        split = self.reasoning.split(text, self.opened, final) if self.reasoning else Split(None, text)
        if self.tools is None:
            return split, Parsed(split.content, [])
        return split, self.tools.parse(split.content, final)

    def feed(self, piece: str) -> list[Event]:
        """Events for the next piece of generated text."""
        self.text += piece
        return self._diff(False)

    def finish(self) -> list[Event]:
        """Events for what was held back, once the answer is complete."""
        self.text += self.suffix
        return self._diff(True)

    @property
    def called(self) -> bool:
        return bool(self._calls)

    def _diff(self, final: bool) -> list[Event]:
        split, parsed = self._parse(self.text, final)
        events = []
        for kind, now in (("reasoning", split.reasoning or ""), ("content", parsed.content)):
            sent = self._sent[kind]
            if len(now) > len(sent) and now.startswith(sent):  # never taken back: only what grew
                events.append(Event(kind, now[len(sent):]))
                self._sent[kind] = now
        for index, call in enumerate(parsed.calls):
            if index == len(self._calls):
                self._calls.append([call_id(), call.name, ""])
                events.append(Event("call", index=index, id=self._calls[index][0], name=call.name))
            sent = self._calls[index][2]
            if len(call.arguments) > len(sent) and call.arguments.startswith(sent):
                events.append(Event("args", call.arguments[len(sent):], index))
                self._calls[index][2] = call.arguments
        return events
