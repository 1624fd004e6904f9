"""OpenAI's tool fields (pydantic): function tools, ``tool_choice``, the history's tool calls.

Shared by chat completions and the Responses API (whose function tools are flat: ``{"type":
"function", "name", "parameters"}``, converted here to chat's nested shape).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, StrictBool, StrictStr

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDef(_Model):
    name: StrictStr
    description: StrictStr | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class Tool(_Model):
    type: Literal["function"]
    function: FunctionDef

    def template_form(self) -> dict:
        """The tool as chat templates (and so the model) see it."""
        return {"type": "function", "function": self.function.model_dump(exclude_none=True)}


class FunctionName(_Model):
    name: StrictStr


class NamedToolChoice(_Model):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class CalledFunction(_Model):
    name: StrictStr
    arguments: StrictStr


class ToolCallIn(_Model):
    """A call in an assistant message of the history."""
    id: StrictStr
    type: Literal["function"] = "function"
    function: CalledFunction


def check_tools(tools: list[Tool] | None, choice: ToolChoice | None, field: str = "tools",
                function_path: str = ".function") -> None:
    """400s naming the field: a bad function name or schema, a repeated name, a ``tool_choice`` that
    names no tool or comes without tools."""
    from quill.serving.protocol import bad_request  # here: protocol imports these models
    seen = set()
    for i, tool in enumerate(tools or ()):
        fn = tool.function
        at = f"{field}[{i}]{function_path}"
        if not NAME.fullmatch(fn.name):
            raise bad_request(f"{at}.name: '{fn.name[:80]}' is not a function name (letters, digits, _ and -, "
                              f"at most 64)", f"{at}.name")
        if fn.name in seen:
            raise bad_request(f"{at}.name: '{fn.name}' names two tools", f"{at}.name")
        seen.add(fn.name)
        kind = (fn.parameters or {}).get("type", "object")
        if kind != "object":
            raise bad_request(f"{at}.parameters: a function's parameters are a JSON schema of type 'object', "
                              f"found type {kind!r}", f"{at}.parameters")
    if choice is None or choice in ("none", "auto"):
        return
    if not tools:
        raise bad_request(f"tool_choice '{_choice_name(choice)}' needs tools, and none were given", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in seen:
        raise bad_request(f"tool_choice names the function '{choice.function.name}', which is not among the "
                          f"tools ({', '.join(sorted(seen))})", "tool_choice")


def _choice_name(choice: ToolChoice) -> str:
    return choice if isinstance(choice, str) else choice.function.name

