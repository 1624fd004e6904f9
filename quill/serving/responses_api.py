"""The Responses API (``POST /v1/responses``) on ``OpenAIServing``: the same engine, prompt rendering,
tool plan and answer parsing as chat completions, answered as a response object with output items
(``reasoning``, ``message``, ``function_call``) or streamed as its typed events.

A stream opens each item as its first text arrives (``response.output_item.added``, a message's or a
thought's ``content_part.added``), sends its text as deltas, and closes it (``*.done`` events) when the
next item begins or the answer ends; ``response.completed`` then carries the whole response, the same
one the request would have got unstreamed.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from dataclasses import replace

from quill.errors import GenerationError
from quill.serving import responses as R
from quill.serving import tool_calls as TC
from quill.serving.openai import EventStream, OpenAIServing, _chunks, _key, _opening, _sampling
from quill.serving.output_parser import Answer, Event
from quill.serving.protocol import APIError, bad_request
from quill.serving.responses_protocol import ResponsesRequest


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(text: str, status: str = "completed") -> dict:
    return {"type": "reasoning", "id": _id("rs"), "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}]}


def message_item(text: str, status: str = "completed") -> dict:
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def call_item(call_id: str, name: str, arguments: str, status: str = "completed") -> dict:
    return {"type": "function_call", "id": _id("fc"), "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(answer: Answer, parallel: bool) -> list[dict]:
    calls = answer.calls if parallel else answer.calls[:1]
    items = [reasoning_item(answer.reasoning)] if answer.reasoning else []
    if answer.content or not items and not calls:  # an empty answer is still one message
        items.append(message_item(answer.content))
    items += [call_item(cid, c.name, c.arguments) for cid, c in calls]
    return items


class ResponsesServing:
    def __init__(self, serving: OpenAIServing):
        self.serving = serving

    async def create(self, req: ResponsesRequest) -> dict | EventStream:
        s = self.serving
        s._check_model(req.model)
        req.refuse_unsupported()
        if s.tokenizer is None:
            raise bad_request("this server has no tokenizer, so it cannot render input items", "input")
        chat = req.chat_request()
        plan = TC.plan(chat.offered_tools, chat.tool_choice, s.tool_parser, chat.parallel_tool_calls)
        params = _sampling(lambda: plan.constrain(replace(chat.sampling_params(req.max_output_tokens, None),
                                                          structured_outputs=req.structured())))
        messages = req.conversation()
        try:
            ids, opened = await asyncio.to_thread(s.render_chat, messages, True, plan)
        except GenerationError as e:
            raise bad_request(str(e), "input") from None
        if params.structured_outputs is None:
            ids = s._check_prompt(ids, req.max_output_tokens, "input", params)
        else:  # the check parses the grammar (the first one imports xgrammar): on a worker thread
            ids = await asyncio.to_thread(s._check_prompt, ids, req.max_output_tokens, "input", params)
        rid = _id("resp")
        handle = await s._submit([(rid, ids, params)], req.user or _key(_opening(messages)), req.stream)
        parser = plan.output_parser(s.reasoning, opened)
        shell = self._shell(req, rid)
        if req.stream:
            return EventStream(self._stream(req, shell, handle, parser, plan), handle)
        choice, usage = R.Choice(), R.Usage()
        try:
            async for _, chunk in _chunks(handle):
                choice.add(chunk)
                usage.add(0, chunk)
        finally:
            handle.close()
        items = output_items(parser.read("".join(choice.text)), plan.parallel)
        return _finished(shell, items, choice.finish_reason, usage)

    def _shell(self, req: ResponsesRequest, rid: str) -> dict:
        """The response object before it has output."""
        choice = req.tool_choice
        return {"id": rid, "object": "response", "created_at": R.now(), "status": "in_progress",
                "model": self.serving.model_name, "output": [], "instructions": req.instructions,
                "tools": [t.model_dump(exclude_none=True) for t in req.tools or ()],
                "tool_choice": choice.model_dump() if hasattr(choice, "model_dump") else (choice or "auto"),
                "parallel_tool_calls": req.parallel_tool_calls, "temperature": req.temperature,
                "top_p": req.top_p, "max_output_tokens": req.max_output_tokens,
                "text": {"format": (req.text.format if req.text and req.text.format else {"type": "text"})},
                "store": False, "metadata": req.metadata or {},
                "previous_response_id": None, "reasoning": req.reasoning, "incomplete_details": None,
                "error": None, "usage": None, "user": req.user}

    async def _stream(self, req, shell, handle, parser, plan) -> AsyncIterator[str]:
        events = _EventWriter(plan.parallel)
        usage, finish = R.Usage(), None
        try:
            yield events.send("response.created", response=shell)
            yield events.send("response.in_progress", response=shell)
            async for _, chunk in _chunks(handle):
                usage.add(0, chunk)
                finish = R.finish_reason(chunk.finish_reason) or finish
                for e in (parser.feed(chunk.text) if chunk.text else []):
                    for sse in events.on(e):
                        yield sse
            for e in parser.finish():
                for sse in events.on(e):
                    yield sse
            for sse in events.end():
                yield sse
            yield events.send("response.completed", response=_finished(shell, events.items, finish, usage))
        except APIError as e:
            yield events.send("error", message=e.message, code=e.code, param=e.param)
        finally:
            handle.close()


def _finished(shell: dict, items: list[dict], finish: str | None, usage: R.Usage) -> dict:
    u = usage.body()
    body = {**shell, "output": items, "status": "incomplete" if finish == "length" else "completed",
            "usage": {"input_tokens": u["prompt_tokens"], "output_tokens": u["completion_tokens"],
                      "total_tokens": u["total_tokens"],
                      "input_tokens_details": {"cached_tokens": u["prompt_tokens_details"]["cached_tokens"]},
                      "output_tokens_details": {"reasoning_tokens": 0}}}
    if finish == "length":
        body["incomplete_details"] = {"reason": "max_output_tokens"}
    return body


class _EventWriter:
    """Output items opened, filled and closed as a stream's answer events come."""

    def __init__(self, parallel: bool):
        self.parallel, self.seq = parallel, 0
        self.items: list[dict] = []
        self.open: dict | None = None  # the item being written

    def send(self, kind: str, **fields) -> str:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(body, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def on(self, e: Event) -> list[str]:
        if e.kind in ("call", "args") and not self.parallel and e.index > 0:
            return []
        out = []
        want = {"reasoning": "reasoning", "content": "message"}.get(e.kind)
        if want is not None and (self.open is None or self.open["type"] != want):
            out += self.close()
            out += self._begin(reasoning_item("", "in_progress") if want == "reasoning"
                               else message_item("", "in_progress"))
        if e.kind == "call":
            out += self.close()
            out += self._begin(call_item(e.id, e.name, "", "in_progress"))
            return out
        item, index = self.open, len(self.items) - 1
        if e.kind == "args":
            item["arguments"] += e.text
            return out + [self.send("response.function_call_arguments.delta", item_id=item["id"],
                                    output_index=index, delta=e.text)]
        item["content"][0]["text"] += e.text
        kind = "response.reasoning_text.delta" if e.kind == "reasoning" else "response.output_text.delta"
        extra = {} if e.kind == "reasoning" else {"logprobs": []}
        return out + [self.send(kind, item_id=item["id"], output_index=index, content_index=0, delta=e.text, **extra)]

    def _begin(self, item: dict) -> list[str]:
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        shown = {**item, "content": []} if "content" in item else dict(item)
        out = [self.send("response.output_item.added", output_index=index, item=shown)]
        if "content" in item:
            out.append(self.send("response.content_part.added", item_id=item["id"], output_index=index,
                                 content_index=0, part=dict(item["content"][0])))
        return out

    def end(self) -> list[str]:
        """Close the last item (an empty answer is still one message)."""
        out = [] if self.items else self._begin(message_item("", "in_progress"))
        return out + self.close()

    def close(self) -> list[str]:
        """The ``*.done`` events of the item being written, if any."""
        if self.open is None:
            return []
        item, index, out = self.open, len(self.items) - 1, []
        self.open = None
        item["status"] = "completed"
        if item["type"] == "function_call":
            out.append(self.send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                 name=item["name"], arguments=item["arguments"]))
        else:
            part = item["content"][0]
            done = "response.reasoning_text.done" if item["type"] == "reasoning" else "response.output_text.done"
            extra = {} if item["type"] == "reasoning" else {"logprobs": []}
            out.append(self.send(done, item_id=item["id"], output_index=index, content_index=0, text=part["text"],
                                 **extra))
            out.append(self.send("response.content_part.done", item_id=item["id"], output_index=index,
                                 content_index=0, part=part))
        out.append(self.send("response.output_item.done", output_index=index, item=item))
        return out
