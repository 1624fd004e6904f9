"""Tool calls in generated text, one parser per model family (vLLM's ``tool_parsers`` read the same formats).

``hermes``  Hermes / Qwen 2.5+ / quill's default for templates without tools:
            ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call.
``llama3_json``  Llama 3.x: the whole answer is ``{"name": ..., "parameters": {...}}`` (after an optional
            ``<|python_tag|>``), several separated by ``;``.
``mistral`` ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` or the newer ``[TOOL_CALLS]name[ARGS]{...}``.

``parse(text, final)`` reads a whole answer (``final``) or the prefix generated so far: then text that
may still become a call is held back, and the last call may be unfinished -- its arguments are the
text generated so far, always a prefix of its final arguments, which is what lets a stream send
argument fragments that reassemble to the non-streamed answer.  A call's ``arguments`` are the JSON
text the model wrote; calls whose JSON does not parse are not calls (the answer is then content).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from quill.errors import ConfigError

# a call object written name first, up to its arguments' value: what lets the arguments stream
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"(?:arguments|parameters)"\s*:\s*')


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text (a prefix of it while unfinished)
    complete: bool = True


@dataclass
class Parsed:
    content: str
    calls: list[ToolCall]


def value_end(text: str, i: int) -> int | None:
    """The index just past the JSON value starting at ``text[i]``; None if it does not end in ``text``."""
    if i >= len(text):
        return None
    depth, in_string, escaped = 0, False, False
    scalar = text[i] not in '{["'
    for k in range(i, len(text)):
        c = text[k]
        if scalar:
            if c in ",}] \t\r\n":
                return k
            continue
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
                if depth == 0:
                    return k + 1
        elif c == '"':
            in_string = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return k + 1
    return None


def _object_end(text: str, i: int) -> int | None:
    return value_end(text, i) if i < len(text) and text[i] == "{" else None


def scan_call(text: str, i: int, final: bool) -> tuple[ToolCall | None, int]:
    """The call object at ``text[i]`` and the index past it; (None, i) if there is none (yet)."""
    head = _CALL_HEAD.match(text, i)
    if head is None:
        end = _object_end(text, i)
        if end is None:
            return None, i
        return _loose_call(text[i:end]), end  # keys in another order: only whole objects are read
    start = head.end()
    args_end = value_end(text, start)
    end = _object_end(text, i)
    name = _unescape(head.group(1))
    if args_end is None or end is None:
        return (None, i) if final else (ToolCall(name, text[start:args_end], False), len(text))
    call = _loose_call(text[i:end])
    if call is None:
        return None, i
    return ToolCall(call.name, text[start:args_end]), end


def _loose_call(obj_text: str) -> ToolCall | None:
    try:
        obj = json.loads(obj_text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a string of JSON
        try:
            json.loads(args)
            return ToolCall(obj["name"], args)
        except json.JSONDecodeError:
            pass
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


def _unescape(s: str) -> str:
    try:
        return json.loads(f'"{s}"')
    except json.JSONDecodeError:
        return s


def _held_back(text: str, marker: str) -> str:
    """``text`` without a last part that may be the beginning of ``marker`` (not yet knowable)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return text[:-n]
    return text


class ToolParser:
    """Reads one family's tool calls; ``call_prefix`` is the text that opens a call (``tool_choice``)."""

    name = ""
    start = ""  # the marker that opens the calls
    args_key = "arguments"
    close = ""  # what follows a call object that ``call_prefix`` opened
    special_start = False  # the marker is a special token, which detokenizing would drop

    def parse(self, text: str, final: bool) -> Parsed:
        at = text.find(self.start)
        if at < 0:
            return Parsed(text if final else _held_back(text, self.start), [])
        calls = self.calls(text, at + len(self.start), final)
        if final and not calls:
            return Parsed(text, [])
        return Parsed(text[:at], calls)

    def calls(self, text: str, i: int, final: bool) -> list[ToolCall]:
        raise NotImplementedError

    def call_prefix(self, name: str | None = None) -> str:
        """What the answer starts with when a call is required (of ``name`` when given)."""
        raise NotImplementedError

    def call_suffix(self, name: str | None = None) -> str:
        """What closes a call ``call_prefix`` opened once its JSON (the arguments, with ``name``) is whole."""
        return ("}" if name else "") + self.close


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class HermesParser(ToolParser):
    name, start, close = "hermes", "<tool_call>", "\n</tool_call>"

    def calls(self, text: str, i: int, final: bool) -> list[ToolCall]:
        def after_marker(j: int) -> int | None:  # each call opens with its own <tool_call>
            nxt = text.find(self.start, j)
            return None if nxt < 0 else nxt + len(self.start)
        return _call_list(text, i, final, after_marker)

    def call_prefix(self, name: str | None = None) -> str:
        return f'{self.start}\n{{"name": {json.dumps(name)}, "arguments": ' if name else f"{self.start}\n"


class Llama3JsonParser(ToolParser):
    name, start, args_key = "llama3_json", "<|python_tag|>", "parameters"

    def parse(self, text: str, final: bool) -> Parsed:
        body = text.lstrip()
        if body.startswith(self.start):
            body = body[len(self.start):].lstrip()
        if not body:
            return Parsed(text if final else "", [])
        if not body.startswith("{"):
            return Parsed(text if final else _held_back(text, self.start), [])
        calls = self.calls(body, 0, final)
        if final and not calls:
            return Parsed(text, [])
        return Parsed("", calls)

    def calls(self, text: str, i: int, final: bool) -> list[ToolCall]:
        return _call_list(text, i, final, _separated(text, ";,"))

    def call_prefix(self, name: str | None = None) -> str:
        return f'{{"name": {json.dumps(name)}, "parameters": ' if name else ""


def _call_list(text: str, i: int, final: bool, next_call) -> list[ToolCall]:
    """JSON calls from ``text[i:]``, up to the first incomplete one; ``next_call(j)``: where the call after
    one ending at ``j`` starts, or None when there is none."""
    out = []
    while True:
        call, j = scan_call(text, _skip_ws(text, i), final)
        if call is None:
            return out
        out.append(call)
        if not call.complete or (i := next_call(j)) is None:
            return out


def _separated(text: str, separators: str):
    """``_call_list``'s ``next_call`` for calls separated by any of ``separators``."""
    def next_call(j: int) -> int | None:
        j = _skip_ws(text, j)
        return j + 1 if j < len(text) and text[j] in separators else None
    return next_call


_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.\-]+)\s*(?:\[ARGS\])?\s*(?=\{)")


class MistralParser(ToolParser):
    name, start, close, special_start = "mistral", "[TOOL_CALLS]", "]", True

    def calls(self, text: str, i: int, final: bool) -> list[ToolCall]:
        i = _skip_ws(text, i)
        if i < len(text) and text[i] == "[":
            return self._array(text, i + 1, final)
        out = []
        while True:  # name[ARGS]{...}[TOOL_CALLS]name[ARGS]{...}
            m = _MISTRAL_NAMED.match(text, i)
            if m is None:
                return out
            end = value_end(text, m.end())
            if end is None:
                if not final:
                    out.append(ToolCall(m.group(1), text[m.end():], False))
                return out
            try:
                json.loads(text[m.end():end])
            except json.JSONDecodeError:
                return out
            out.append(ToolCall(m.group(1), text[m.end():end]))
            i = _skip_ws(text, end)
            if text.startswith(self.start, i):
                i += len(self.start)

    def _array(self, text: str, i: int, final: bool) -> list[ToolCall]:
        return _call_list(text, i, final, _separated(text, ","))

    def call_prefix(self, name: str | None = None) -> str:
        return f'{self.start}[{{"name": {json.dumps(name)}, "arguments": ' if name else f"{self.start}["


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser)}


def tool_parser(name: str) -> ToolParser:
    """The parser called ``name``; a ConfigError lists the known ones."""
    try:
        return PARSERS[name]()
    except KeyError:
        raise ConfigError(f"--tool-call-parser: unknown parser '{name}'; known: {', '.join(PARSERS)}") from None


def parser_for_template(template: str | None) -> str:
    """The parser of the family whose chat template this is (``hermes`` for templates without tools,
    for which quill writes the tools in Hermes' format)."""
    template = template or ""
    if "[TOOL_CALLS]" in template:
        return MistralParser.name
    if "<tool_call>" in template or "tools" not in template:
        return HermesParser.name
    if "<|python_tag|>" in template or "<|start_header_id|>" in template:
        return Llama3JsonParser.name
    return HermesParser.name
