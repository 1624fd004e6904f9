"""Tools and tool calls in chat templates, as transformers' ``apply_chat_template(messages, tools=...)``.

Templates written for tools (Qwen, Llama 3.1+, Mistral, Hermes) get ``tools`` and the history's
``tool_calls`` / ``tool`` messages as they are, with each call's ``arguments`` as a dict (vLLM
does the same: the templates ``tojson`` them).  A template that never mentions ``tools`` (SmolLM2's,
quill's default model) would silently drop them, so quill writes them in Hermes' words instead --
the tool list into the system message, past calls as ``<tool_call>`` text, results as
``<tool_response>`` user turns -- which the ``hermes`` tool-call parser reads back.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

HERMES_SYSTEM = (
    "You are a function calling AI model. You are provided with function signatures within <tools></tools> "
    "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions about "
    "what values to plug into functions.\n\n<tools>\n{tools}\n</tools>\n\nFor each function call, return a json "
    "object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def takes_tools(template: str) -> bool:
    """Whether a chat template reads the ``tools`` variable (otherwise quill writes them itself)."""
    return "tools" in template


def template_messages(messages: Sequence[Mapping[str, Any]], tools: Sequence[Mapping] | None,
                      template: str) -> tuple[list[dict], list[dict] | None]:
    """The messages and tools to render with ``template``: arguments as dicts; for a template without
    tool support, tools and calls written into the messages in Hermes' format (tools then None)."""
    messages = [_with_dict_arguments(dict(m)) for m in messages]
    if "length 9" in template:  # Mistral's templates refuse other ids (vLLM cuts them the same way)
        messages = [_short_ids(m) for m in messages]
    if takes_tools(template):
        # content null (an assistant turn of calls only) as "": templates test `'</think>' in content`
        messages = [{**m, "content": ""} if m.get("content") is None else m for m in messages]
        return messages, list(tools) if tools else None
    out = [_hermes_message(m) for m in messages]
    if tools:
        listing = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
        system = HERMES_SYSTEM.format(tools=listing)
        if out and out[0].get("role") == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out, None


def _with_dict_arguments(message: dict) -> dict:
    calls = message.get("tool_calls")
    if not calls:
        return message
    fixed = []
    for call in calls:
        call = dict(call)
        fn = dict(call.get("function") or {})
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                fn["arguments"] = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError:
                pass  # not JSON: the template gets the text the client sent
        call["function"] = fn
        fixed.append(call)
    return {**message, "tool_calls": fixed}


def mistral_id(call_id: str) -> str:
    """A tool-call id as Mistral's templates take them: 9 letters or digits (the last ones of ``call_id``)."""
    return ("".join(c for c in call_id if c.isalnum())[-9:]).rjust(9, "0")


def _short_ids(message: dict) -> dict:
    if message.get("tool_call_id") is not None:
        message = {**message, "tool_call_id": mistral_id(str(message["tool_call_id"]))}
    if message.get("tool_calls"):
        message = {**message, "tool_calls": [{**c, "id": mistral_id(str(c.get("id", "")))}
                                             for c in message["tool_calls"]]}
    return message


def _hermes_message(message: dict) -> dict:
    """One message in plain roles and text, for a template that knows no tool calls."""
    role, content = message.get("role"), message.get("content")
    if role == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content or ''}\n</tool_response>"}
    calls = message.get("tool_calls")
    if role == "assistant" and calls:
        parts = [content] if content else []
        for call in calls:
            fn = call.get("function") or {}
            body = {"name": fn.get("name"), "arguments": fn.get("arguments")}
            parts.append(f"<tool_call>\n{json.dumps(body, ensure_ascii=False)}\n</tool_call>")
        return {"role": role, "content": "\n".join(parts)}
    if content is None:  # an assistant turn with no text: templates concatenate content as a string
        return {**message, "content": ""}
    return message
