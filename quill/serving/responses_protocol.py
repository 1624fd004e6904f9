"""The Responses API's request (``POST /v1/responses``, pydantic) and its translation into a chat request.

``input`` is text or a list of items: messages (text or ``input_text`` / ``output_text`` parts),
``function_call`` (an earlier call: an assistant message with ``tool_calls``; consecutive calls join
one message) and ``function_call_output`` (its result: a ``tool`` message); ``reasoning`` items of
earlier turns are dropped, as chat templates drop old thoughts.  ``instructions`` becomes the system
message.  Function tools are flat here (``{"type": "function", "name", "parameters"}``); the chat
request nests them.  quill keeps nothing between requests: ``store`` is accepted and ignored,
``previous_response_id`` is refused.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

from quill.engine.structured import StructuredOutputs
from quill.serving.protocol import ROLES, ChatCompletionRequest, Float, StreamOptions, bad_request
from quill.serving.protocol_tools import FunctionDef, FunctionName, NamedToolChoice, Tool, check_tools


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionTool(_Model):
    type: StrictStr
    name: StrictStr | None = None
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionChoice(_Model):
    type: Literal["function"]
    name: StrictStr


class TextConfig(_Model):
    format: dict[str, Any] | None = None


class ResponsesRequest(_Model):
    """``POST /v1/responses``."""

    input: StrictStr | list[dict[str, Any]]
    model: StrictStr | None = None
    instructions: StrictStr | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    max_output_tokens: StrictInt | None = Field(None, ge=1)
    temperature: Float | None = Field(None, ge=0.0, le=2.0)
    top_p: Float | None = Field(None, gt=0.0, le=1.0)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    store: StrictBool | None = None
    previous_response_id: StrictStr | None = None
    reasoning: dict[str, Any] | None = None
    metadata: dict[str, StrictStr] | None = None
    user: StrictStr | None = None

    def refuse_unsupported(self) -> None:
        if self.previous_response_id is not None:
            raise bad_request("previous_response_id: quill keeps no responses (it is stateless); send the whole "
                              "conversation in input instead", "previous_response_id", "unsupported_parameter")
        for i, tool in enumerate(self.tools or ()):
            if tool.type != "function":
                raise bad_request(f"tools[{i}].type '{tool.type}' is not supported; supported: function",
                                  f"tools[{i}].type", "unsupported_parameter")
            if tool.name is None:
                raise bad_request(f"tools[{i}].name: this field is required", f"tools[{i}].name",
                                  "missing_required_parameter")
        check_tools(self.chat_tools(), self.chat_tool_choice(), "tools", "")
        kind = self.format_type
        if kind not in ("text", "json_schema", "json_object"):
            raise bad_request(f"text.format type '{kind}' is not supported; supported: text, json_schema, "
                              "json_object", "text.format.type", "unsupported_parameter")
        if kind == "json_schema" and not isinstance(self.text.format.get("schema"), dict):
            raise bad_request("text.format.schema: a json_schema format needs its schema (an object)",
                              "text.format.schema")

    @property
    def format_type(self) -> str:
        return (self.text.format or {}).get("type", "text") if self.text else "text"

    def structured(self) -> StructuredOutputs | None:
        """``text.format`` as the engine's constraint (JSON schema or any JSON object)."""
        if self.format_type == "json_schema":
            return StructuredOutputs(json=self.text.format["schema"], source="text.format.schema")
        if self.format_type == "json_object":
            return StructuredOutputs(json_object=True, source="text.format")
        return None

    def chat_tools(self) -> list[Tool] | None:
        if not self.tools:
            return None
        return [Tool(type="function", function=FunctionDef(name=t.name, description=t.description,
                                                          parameters=t.parameters, strict=t.strict))
                for t in self.tools]

    def chat_tool_choice(self):
        if isinstance(self.tool_choice, FunctionChoice):
            return NamedToolChoice(type="function", function=FunctionName(name=self.tool_choice.name))
        return self.tool_choice

    def chat_request(self) -> ChatCompletionRequest:
        """The same request as a chat completion, for its sampling parameters and tool plan (the fields
        were checked here; the others take their defaults)."""
        return ChatCompletionRequest.model_construct(
            messages=[], model=self.model, max_completion_tokens=self.max_output_tokens, max_tokens=None,
            temperature=self.temperature, top_p=self.top_p, stream=self.stream, tools=self.chat_tools(),
            tool_choice=self.chat_tool_choice(), parallel_tool_calls=self.parallel_tool_calls, user=self.user)

    def conversation(self) -> list[dict]:
        """``instructions`` and ``input`` as chat template messages."""
        out = [{"role": "system", "content": self.instructions}] if self.instructions else []
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        if not self.input:
            raise bad_request("input must not be empty", "input")
        for i, item in enumerate(self.input):
            _add_item(out, item, f"input[{i}]")
        return out


def _text(content, at: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{at}.content: expected text or a list of text parts", f"{at}.content")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in ("input_text", "output_text", "text") \
                or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise bad_request(f"{at}.content[{j}]: part type '{kind}' is not supported; supported: input_text, "
                              "output_text", f"{at}.content[{j}]", "unsupported_parameter")
        parts.append(part["text"])
    return "".join(parts)


def _string(item: dict, key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{at}.{key}: expected a string, found {type(value).__name__}", f"{at}.{key}")
    return value


def _add_item(out: list[dict], item: dict, at: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in ROLES or role == "tool":
            raise bad_request(f"{at}.role '{role}' is not supported; supported: system, developer, user, "
                              "assistant", f"{at}.role")
        out.append({"role": "system" if role == "developer" else role, "content": _text(item.get("content"), at)})
    elif kind == "function_call":
        call = {"id": _string(item, "call_id", at), "type": "function",
                "function": {"name": _string(item, "name", at), "arguments": _string(item, "arguments", at)}}
        last = out[-1] if out else None
        if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
            last["tool_calls"].append(call)
        else:
            out.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        text = output if isinstance(output, str) else _text(output, at)
        out.append({"role": "tool", "tool_call_id": _string(item, "call_id", at), "content": text})
    elif kind != "reasoning":
        raise bad_request(f"{at}.type '{kind}' is not supported; supported: message, function_call, "
                          "function_call_output, reasoning", f"{at}.type", "unsupported_parameter")
