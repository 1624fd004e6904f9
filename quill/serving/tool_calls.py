"""Tool calling on a chat request: what the prompt offers and forces, and the answer's message and deltas.

``tool_choice``: ``none`` -- the tools are not shown to the model and its text is all content; ``auto``
-- shown, and calls in the answer are read by the model family's parser; ``required`` / a named
function -- the answer is opened with the family's call opening (``ToolParser.call_prefix``) written
into the prompt, the rest of the call is held to its JSON schema (structured outputs: the named
function's parameters, or any tool's ``{"name", "arguments"}`` object), and the call's closing text is
added once that JSON is whole, so a forced call always parses.  ``parallel_tool_calls: false`` keeps
the first call.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from quill.engine.sampling import SamplingParams
from quill.engine.structured import StructuredOutputs
from quill.serving.output_parser import Answer, Event, OutputParser
from quill.serving.protocol_tools import NamedToolChoice
from quill.serving.reasoning import ReasoningParser
from quill.serving.tool_parsers import ToolParser


@dataclass
class ToolPlan:
    tools: list[dict] | None = None  # for the chat template
    parser: ToolParser | None = None  # None: the answer is not read for calls
    prefix: str = ""  # the answer's opening, written into the prompt
    parallel: bool = True
    schema: dict | None = None  # what the generated rest of a forced call is held to
    suffix: str = ""  # the forced call's closing, after its JSON

    def output_parser(self, reasoning: ReasoningParser | None, opened: bool) -> OutputParser:
        return OutputParser(self.parser, reasoning, opened, self.prefix, self.suffix)

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` holding a forced call to its schema (a forced call replaces other constraints), and
        keeping special tokens in the text when the family's call marker is one (Mistral's, as vLLM does)."""
        if self.parser is not None and self.parser.special_start:
            params = replace(params, skip_special_tokens=False)
        if self.schema is None:
            return params
        return replace(params, structured_outputs=StructuredOutputs(json=self.schema, source="tools"))


def plan(tools: list[dict] | None, choice, parser: ToolParser, parallel: bool = True) -> ToolPlan:
    """``tools``: those offered (template form; None with ``tool_choice: "none"``)."""
    if not tools:
        return ToolPlan()
    named = choice.function.name if isinstance(choice, NamedToolChoice) else None
    if choice != "required" and named is None:
        return ToolPlan(tools, parser, parallel=parallel)
    return ToolPlan(tools, parser, parser.call_prefix(named), parallel, _schema(tools, named, parser.args_key),
                    parser.call_suffix(named))


def _schema(tools: list[dict], name: str | None, args_key: str) -> dict:
    """The named function's parameters, or (``required``) one call object of any tool, name first."""
    functions = [t["function"] for t in tools]
    if name is not None:
        return next(f for f in functions if f["name"] == name).get("parameters") or {"type": "object"}
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               args_key: f.get("parameters") or {"type": "object"}},
              "required": ["name", args_key], "additionalProperties": False} for f in functions]
    return calls[0] if len(calls) == 1 else {"anyOf": calls}


def message(answer: Answer, parallel: bool) -> dict:
    """The assistant message's fields beyond ``role`` (OpenAI's: ``content`` null when only calls)."""
    calls = answer.calls if parallel else answer.calls[:1]
    out = {"content": answer.content if (answer.content or not calls) else None}
    if answer.reasoning is not None:
        out["reasoning_content"] = answer.reasoning
    if calls:
        out["tool_calls"] = [{"id": cid, "type": "function",
                              "function": {"name": c.name, "arguments": c.arguments}} for cid, c in calls]
    return out


def delta(event: Event, parallel: bool = True) -> dict | None:
    """A chat stream's delta for one event (OpenAI's shape: id, type and name first, then argument text)."""
    if event.kind in ("content", "reasoning"):
        return {"content" if event.kind == "content" else "reasoning_content": event.text}
    if not parallel and event.index > 0:
        return None
    if event.kind == "call":
        return {"tool_calls": [{"index": event.index, "id": event.id, "type": "function",
                                "function": {"name": event.name, "arguments": ""}}]}
    return {"tool_calls": [{"index": event.index, "function": {"arguments": event.text}}]}


def finish_reason(reason: str | None, called: bool) -> str | None:
    """"tool_calls" for an answer that ended on its own with calls in it."""
    return "tool_calls" if called and reason == "stop" else reason
