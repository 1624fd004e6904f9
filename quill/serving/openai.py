"""The OpenAI API on an engine, independent of the HTTP host (FastAPI here, a Ray Serve ingress too).

``OpenAIServing`` validates a parsed request against the model (name, context window,
prompt tokens), submits it to the engine (``AsyncEngine.submit`` or anything with its
shape) and returns either a response body or an async iterator of Server-Sent Events.
Everything that can be refused is refused before the engine sees the request, so a
stream never starts with an error.  A request that then fails inside the engine (a fault of
its own; the engine goes on) is a 500 ``server_error``, or a stream's last error event.
Tokenizing and rendering chat templates run on worker threads, so a huge prompt does not hold
up the event loop (and the other clients on it).
"""

from __future__ import annotations

import asyncio
import hashlib
import inspect
import json
import re
from collections.abc import AsyncIterator, Callable

from quill.engine.structured import StructuredOutputError
from quill.errors import GenerationError
from quill.serving import responses as R
from quill.serving import tool_calls as TC
from quill.serving.engine import EngineStopped, ServerBusy
from quill.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest, bad_request
from quill.serving.reasoning import reasoning_parser as make_reasoning_parser
from quill.serving.tool_parsers import parser_for_template
from quill.serving.tool_parsers import tool_parser as make_tool_parser


class EventStream:
    """The SSE text of one streamed response; ``aclose()`` ends it and aborts what is unfinished,
    whether the stream ran to its end, was cut short, or never started."""

    def __init__(self, events: AsyncIterator[str], handle):
        self.events, self.handle = events, handle
        self._joined = self._join()

    def __aiter__(self) -> AsyncIterator[str]:
        return self._joined

    async def _join(self) -> AsyncIterator[str]:
        """The events, those of chunks that arrived together joined into one write (one send, one
        wake-up of the client) -- a handle with ``ready()`` says whether another chunk is waiting."""
        ready = getattr(self.handle, "ready", None)
        parts = []
        async for event in self.events:
            parts.append(event)
            if ready is None or not ready():
                yield "".join(parts)
                parts.clear()
        if parts:
            yield "".join(parts)

    def abort(self) -> None:
        """Abort what is unfinished now (the client has gone); ``aclose()`` still ends the stream."""
        self.handle.close()

    async def aclose(self) -> None:
        try:
            await self._joined.aclose()
        finally:
            try:
                await self.events.aclose()
            finally:
                self.handle.close()


class OpenAIServing:
    """Completions and chat completions for one served model.

    ``engine``: ``check(ids, label) -> ids`` and ``submit([(id, ids, params)], affinity=key) -> handle``
    (or an awaitable of one; an async iterable of ``(index, StreamChunk)`` with ``close()``).  ``affinity``
    (requests with one key share a prefix cache) and ``streamed`` (False: nothing is sent before the
    end) are hints for an engine over replicas; one engine ignores them.  ``tokenizer``: ``quill.tokenizer.Tokenizer``.
    ``tool_call_parser`` / ``reasoning_parser``: names (``quill.serving.tool_parsers`` / ``reasoning``), or
    "auto": the model family's, from its chat template.
    """

    def __init__(self, engine, tokenizer, model_name: str, context_length: int, created: int | None = None,
                 tool_call_parser: str = "auto", reasoning_parser: str = "auto"):
        self.engine, self.tokenizer = engine, tokenizer
        self.model_name, self.context_length = model_name, context_length
        self.created = created or R.now()
        template = tokenizer.spec.chat_template if tokenizer is not None else None
        if tool_call_parser == "auto":
            tool_call_parser = parser_for_template(template)
        self.tool_parser = make_tool_parser(tool_call_parser)
        self.reasoning = make_reasoning_parser(reasoning_parser, template)

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": self.created,
                                            "owned_by": "quill", "max_model_len": self.context_length}]}

    # ---- shared checks -----------------------------------------------------------------------
    def _check_model(self, name: str | None) -> None:
        if name is not None and name != self.model_name:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{self.model_name}'",
                           "model", "model_not_found")

    def _check_prompt(self, ids: list[int], max_tokens: int | None, param: str, params) -> list[int]:
        """The prompt's ids checked against the model, with ``params``' token ids (a 400 names the field)."""
        try:
            ids = self.engine.check(ids, param, params)
        except GenerationError as e:
            raise _param_error(e, param) from None
        if max_tokens is not None and len(ids) + max_tokens > self.context_length:
            raise bad_request(f"This model's maximum context length is {self.context_length} tokens, but "
                              f"{len(ids) + max_tokens} were requested ({len(ids)} in the prompt, {max_tokens} "
                              f"to generate); shorten the prompt or lower max_tokens", "max_tokens",
                              "context_length_exceeded")
        return ids

    async def _checked(self, ids: list[int], max_tokens: int | None, param: str, params) -> list[int]:
        """``_check_prompt``, on a worker thread when it parses a grammar (the first imports xgrammar: ~1 s)."""
        if params.structured_outputs is None:
            return self._check_prompt(ids, max_tokens, param, params)
        return await asyncio.to_thread(self._check_prompt, ids, max_tokens, param, params)

    async def _submit(self, requests: list[tuple[str, list[int], object]], affinity: str | None, streamed: bool):
        try:
            handle = self.engine.submit(requests, affinity=affinity, streamed=streamed)
            return (await handle) if inspect.isawaitable(handle) else handle
        except ServerBusy as e:
            raise APIError(503, str(e), None, "server_busy", "server_error", {"Retry-After": "1"}) from None
        except EngineStopped as e:
            raise APIError(503, str(e), None, "engine_unavailable", "server_error") from None
        except GenerationError as e:  # a submission the engine can never hold: retrying cannot help
            raise bad_request(str(e), "n") from None

    async def _tokenize(self, prompt) -> list[tuple[str | None, list[int]]]:
        """A completion's ``prompt`` field as (text, ids) per prompt (text is encoded on a worker thread)."""
        if isinstance(prompt, str):
            prompt = [prompt]
        elif not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        if isinstance(prompt[0], int):
            return [(None, list(prompt))]
        if isinstance(prompt[0], list):
            return [(None, list(p)) for p in prompt]
        if self.tokenizer is None:
            raise bad_request("this server has no tokenizer; send token ids", "prompt")
        ids = await asyncio.to_thread(lambda: [self.tokenizer.encode(p) for p in prompt])
        return list(zip(prompt, ids))

    # ---- completions --------------------------------------------------------------------------
    async def completions(self, req: CompletionRequest) -> dict | EventStream:
        """``POST /v1/completions``: a body, or SSE text when ``stream``."""
        self._check_model(req.model)
        req.refuse_unsupported()
        k = req.logprobs
        echo_lp = k if (req.echo and k is not None) else None
        params = [_sampling(lambda j=j: req.sampling_params(req.max_tokens, k, echo_lp, j)) for j in range(req.n)]
        prompts = await self._tokenize(req.prompt)
        many = len(prompts) > 1
        ids = [await self._checked(p, req.max_tokens, f"prompt[{i}]" if many else "prompt", params[0])
               for i, (_, p) in enumerate(prompts)]
        rid = R.new_id("cmpl")
        subs = [(f"{rid}-{i}-{j}", p, params[j]) for i, p in enumerate(ids) for j in range(req.n)]
        handle = await self._submit(subs, req.user or _key(ids[0][:AFFINITY_TOKENS]), req.stream)
        echo = [self._echo_text(text, p) if req.echo else "" for (text, _), p in zip(prompts, ids)]
        if req.stream:
            return EventStream(self._completion_stream(req, rid, handle, echo, k), handle)
        return await self._completion_full(req, rid, handle, echo, k)

    def _echo_text(self, text: str | None, ids: list[int]) -> str:
        if text is not None or self.tokenizer is None:
            return text or ""
        return self.tokenizer.decode(ids, skip_special_tokens=False)

    def _token_text(self, token: int) -> str:
        """A prompt token's text for echoed log-probs (generated tokens carry theirs; the id without a tokenizer)."""
        return str(token) if self.tokenizer is None else self.tokenizer.decode([token], skip_special_tokens=False)

    async def _completion_full(self, req, rid, handle, echo, k) -> dict:
        choices = [R.Choice() for _ in range(len(echo) * req.n)]
        usage, prompt_lps = R.Usage(), {}
        try:
            async for index, chunk in _chunks(handle):
                choices[index].add(chunk)
                usage.add(index // req.n, chunk)
                if chunk.prompt_logprobs is not None:
                    prompt_lps[index] = chunk.prompt_logprobs
        finally:
            handle.close()
        out = []
        for index, c in enumerate(choices):
            pre = echo[index // req.n]
            lp = None
            if k is not None:
                entries = _prompt_entries(handle, index, prompt_lps.get(index)) if req.echo else []
                lp = R.completion_logprobs(entries + c.logprobs, 0 if req.echo else len(pre), k, self._token_text)
            out.append(R.completion_choice(index, pre + "".join(c.text), lp, c.finish_reason, c.stop_reason))
        return R.completion_body(rid, R.now(), self.model_name, out, usage)

    async def _completion_stream(self, req, rid, handle, echo, k) -> AsyncIterator[str]:
        created, usage = R.now(), R.Usage()
        offsets = [0] * (len(echo) * req.n)  # text offset of each choice's next token (logprobs)
        started = [False] * len(offsets)
        try:
            async for index, chunk in _chunks(handle):
                usage.add(index // req.n, chunk)
                text, entries = chunk.text, []
                if not started[index]:  # a choice's first chunk carries the echoed prompt
                    started[index] = True
                    pre = echo[index // req.n]
                    text = pre + text
                    if req.echo and k is not None:
                        entries = _prompt_entries(handle, index, chunk.prompt_logprobs)
                    else:
                        offsets[index] = len(pre)
                lp = None
                if k is not None:
                    if chunk.token_id is not None and chunk.logprobs is not None:
                        entries.append((chunk.token_id, chunk.logprobs))
                    lp = R.completion_logprobs(entries, offsets[index], k, self._token_text)
                    offsets[index] += sum(len(t) for t in lp["tokens"])
                finish = R.finish_reason(chunk.finish_reason)
                choice = R.completion_choice(index, text, lp, finish, chunk.stop_reason if finish else None)
                body = R.completion_body(rid, created, self.model_name, [choice], None)
                if req.include_usage:
                    body["usage"] = None
                yield R.sse(body)
            if req.include_usage:
                yield R.sse(R.completion_body(rid, created, self.model_name, [], usage))
            yield R.SSE_DONE
        except APIError as e:  # the engine stopped mid-stream: the status is sent already, so say it in the stream
            yield R.sse(e.body())
            yield R.SSE_DONE
        finally:
            handle.close()

    # ---- chat ---------------------------------------------------------------------------------
    async def chat(self, req: ChatCompletionRequest) -> dict | EventStream:
        """``POST /v1/chat/completions``: a body, or SSE text when ``stream``."""
        self._check_model(req.model)
        req.refuse_unsupported()
        if self.tokenizer is None:
            raise bad_request("this server has no tokenizer, so it cannot render chat messages", "messages")
        limit = req.completion_limit
        k = (req.top_logprobs or 0) if req.logprobs else None
        params = [_sampling(lambda j=j: req.sampling_params(limit, k, None, j)) for j in range(req.n)]
        plan = TC.plan(req.offered_tools, req.tool_choice, self.tool_parser, req.parallel_tool_calls)
        params = [_sampling(lambda p=p: plan.constrain(p)) for p in params]
        try:  # jinja and the tokenizer on a worker thread: a long conversation does not stall the loop
            ids, opened = await asyncio.to_thread(self.render_chat, req.conversation(), req.add_generation_prompt,
                                                  plan, req.chat_template_kwargs)
        except GenerationError as e:
            raise bad_request(str(e), "messages") from None
        ids = await self._checked(ids, limit, "messages", params[0])
        rid = R.new_id("chatcmpl")
        subs = [(f"{rid}-{j}", ids, params[j]) for j in range(req.n)]
        handle = await self._submit(subs, req.user or _key(_opening(req.conversation())), req.stream)
        if req.stream:
            return EventStream(self._chat_stream(req, rid, handle, k, plan, opened), handle)
        choices, usage = [R.Choice() for _ in range(req.n)], R.Usage()
        try:
            async for index, chunk in _chunks(handle):
                choices[index].add(chunk)
                usage.add(0, chunk)
        finally:
            handle.close()
        return R.chat_body(rid, R.now(), self.model_name,
                           [self._chat_choice(i, c, k, plan, opened) for i, c in enumerate(choices)], usage)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool, plan: TC.ToolPlan,
                    template_kwargs: dict | None = None) -> tuple[list[int], bool]:
        """A conversation's prompt ids (the plan's tools shown, its call opening written) and whether the
        prompt leaves the answer inside a thought."""
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt, plan.tools,
                                                  template_kwargs) + plan.prefix
        opened = self.reasoning is not None and self.reasoning.opened_by(text)
        return self.tokenizer.encode(text, add_special_tokens=False), opened

    def answer_parser(self, plan: TC.ToolPlan, opened: bool):
        """An ``OutputParser`` for one answer; None when there is nothing to read (all content)."""
        if plan.parser is None and self.reasoning is None:
            return None
        return plan.output_parser(self.reasoning, opened)

    def _chat_choice(self, index: int, choice: R.Choice, k, plan: TC.ToolPlan, opened: bool) -> dict:
        body = R.chat_choice(index, choice, k)
        parser = self.answer_parser(plan, opened)
        if parser is not None:
            answer = parser.read("".join(choice.text))
            body["message"].update(TC.message(answer, plan.parallel))
            body["finish_reason"] = TC.finish_reason(body["finish_reason"], bool(answer.calls))
        return body

    async def _chat_stream(self, req, rid, handle, k, plan, opened) -> AsyncIterator[str]:
        created, usage, inc = R.now(), R.Usage(), req.include_usage
        parsers = [self.answer_parser(plan, opened) for _ in range(req.n)]
        try:
            for j in range(req.n):  # the role first, as OpenAI streams it
                role = {"index": j, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                        "finish_reason": None}
                yield R.sse(R.chat_chunk(rid, created, self.model_name, [role], None, inc))
            async for index, chunk in _chunks(handle):
                usage.add(0, chunk)
                lp = None
                if k is not None and chunk.token_id is not None and chunk.logprobs is not None:
                    lp = R.chat_logprobs([(chunk.token_id, chunk.logprobs)], k)
                finish = R.finish_reason(chunk.finish_reason)
                deltas = _deltas(parsers[index], chunk.text, finish, plan.parallel)
                if parsers[index] is not None:
                    finish = TC.finish_reason(finish, parsers[index].called)
                for delta in deltas[:-1]:  # a piece that completes several things: one chunk each
                    choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
                    yield R.sse(R.chat_chunk(rid, created, self.model_name, [choice], None, inc))
                if deltas or lp is not None or finish:
                    delta = deltas[-1] if deltas else {}
                    choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
                    if finish:
                        choice["stop_reason"] = chunk.stop_reason
                    yield R.sse(R.chat_chunk(rid, created, self.model_name, [choice], None, inc))
            if inc:
                yield R.sse(R.chat_chunk(rid, created, self.model_name, [], usage.body(), True))
            yield R.SSE_DONE
        except APIError as e:
            yield R.sse(e.body())
            yield R.SSE_DONE
        finally:
            handle.close()


AFFINITY_TOKENS = 64  # a completion's routing key: its first tokens (4 KV blocks)


def _deltas(parser, text: str, finish: str | None, parallel: bool) -> list[dict]:
    """A streamed piece's chat deltas: its text as content, or what ``parser`` reads in it."""
    if parser is None:
        return [{"content": text}] if text else []
    events = (parser.feed(text) if text else []) + (parser.finish() if finish else [])
    return [d for e in events if (d := TC.delta(e, parallel)) is not None]


def _opening(messages: list[dict]) -> list[dict]:
    """A chat's messages up to its first user message: what every later turn of it starts with."""
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            return messages[:i + 1]
    return messages


def _key(value) -> str:
    return hashlib.blake2b(json.dumps(value, sort_keys=True).encode(), digest_size=8).hexdigest()


async def _chunks(handle) -> AsyncIterator:
    """The handle's ``(index, chunk)`` pairs; an engine that stops under them becomes a 503, a request
    the engine itself refuses (checked here already, so a race or a replica with a smaller KV pool) a 400,
    and one that failed inside the engine (its own fault; the engine goes on) a 500."""
    try:
        async for item in handle:
            if item[1].error is not None:
                raise APIError(500, f"the request failed inside the engine: {item[1].error}", None,
                               "request_failed", "server_error")
            yield item
    except EngineStopped as e:
        raise APIError(503, str(e), None, "engine_unavailable", "server_error", {"Retry-After": "1"}) from None
    except GenerationError as e:
        raise _param_error(e) from None


def _prompt_entries(handle, index: int, lps: list | None) -> list:
    """(token, log-prob dict or None) per prompt position, for ``echo`` with ``logprobs``."""
    ids = handle.sub.requests[index][1]
    return [(t, None) for t in ids] if lps is None else list(zip(ids, lps))


_PARAM = re.compile(r"^SamplingParams\.(\w+):")


def _param_error(e: GenerationError, default: str | None = None) -> APIError:
    """A 400 naming the SamplingParams field the message starts with (else ``default``), or the request
    field an invalid structured-output spec came from."""
    if isinstance(e, StructuredOutputError):
        return bad_request(str(e), e.source)
    m = _PARAM.match(str(e))
    return bad_request(str(e), m.group(1) if m else default)


def _sampling(make: Callable[[], object]):
    """Build SamplingParams; their own checks (e.g. min_tokens > max_tokens) become 400s naming the field."""
    try:
        return make()
    except GenerationError as e:
        raise _param_error(e) from None
