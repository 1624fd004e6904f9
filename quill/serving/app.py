"""The HTTP host: a FastAPI app over ``OpenAIServing`` (routes, API key, errors, metrics, disconnects).

    app = create_app(llm, ServeConfig(api_key="sk-..."))     # owns an AsyncEngine started by the lifespan
    uvicorn.run(app, host="127.0.0.1", port=8000)

``build_app`` takes any ``OpenAIServing`` (the Ray ingress builds its own over replicas).
Every error is OpenAI's schema: invalid fields 400 (the field named; also bodies that are not
JSON, nest too deep or hold a lone UTF-16 surrogate), a missing or wrong API key 401, an unknown
model or route 404, a full queue 503 with ``Retry-After``, an unexpected exception a logged 500;
the limits of ``http_limits`` (Host, Content-Type, body size and time) answer 400, 415, 413, 408.
A client that goes away has its requests aborted, streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from quill import __version__
from quill.serving.engine import AsyncEngine
from quill.serving.http_limits import HttpLimits, RequestGuard, allowed_hosts
from quill.serving.metrics import ServerMetrics
from quill.serving.openai import OpenAIServing
from quill.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest
from quill.serving.responses_api import ResponsesServing
from quill.serving.responses_protocol import ResponsesRequest

log = logging.getLogger("quill.serving")


@dataclass(frozen=True)
class ServeConfig:
    """Server options beyond the engine's (``EngineConfig``) and the model's."""

    model_name: str | None = None  # the name clients use; default: the checkpoint's file or directory name
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    max_waiting: int = 256  # requests queued beyond the running batch before 503
    stream_interval: int = 1  # tokens a streamed request gathers before they are sent (AsyncEngine)
    max_body_size: int = HttpLimits.max_body_size  # bytes; larger request bodies get 413
    header_timeout: float = 10.0  # seconds a request's headers may take (the uvicorn protocol's deadline)
    body_timeout: float = HttpLimits.body_timeout  # seconds its body may take after them, else 408
    host: str | None = None  # the address the server is bound to: Host headers must name it (or a loopback)
    allowed_hosts: tuple[str, ...] = ()  # more Host names to answer ("*": any)
    allowed_origins: tuple[str, ...] = ()  # browser origins CORS lets call the API; none by default
    tool_call_parser: str = "auto"  # quill.serving.tool_parsers name; auto: the model family's (its chat template)
    reasoning_parser: str = "auto"  # quill.serving.reasoning name, or none; auto: qwen3 for thinking templates

    def http_limits(self) -> HttpLimits:
        return HttpLimits(self.max_body_size, self.body_timeout, allowed_hosts(self.host, self.allowed_hosts))


class _EventStream(StreamingResponse):
    """An SSE response that closes its source however it ends (finished, client gone, never started)."""

    def __init__(self, source):
        super().__init__(source, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.source = source

    async def __call__(self, scope, receive, send) -> None:
        async def receive_watched():
            message = await receive()
            if message["type"] == "http.disconnect":
                # Abort at once rather than when Starlette's cancel scope stops the stream: anyio cancels a
                # task only while it waits on a pending future, and with the engine stepping on this loop a
                # new chunk wakes the stream before every retry, so that never happened (the request ran
                # on to max_tokens).
                self.source.abort()
            return message

        try:
            await super().__call__(scope, receive_watched, send)
        finally:
            await self.source.aclose()


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (the body is already read, so only a disconnect can arrive)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, work) -> object | None:
    """Await ``work``; if the client goes first, cancel it (its requests are aborted) and return None."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return None
    return task.result()


async def _answer(request: Request, stream: bool, work):
    """A streamed response as SSE; a whole one as JSON unless the client leaves first (499, never sent)."""
    if stream:
        return _EventStream(await work)
    body = await _unless_disconnected(request, work)
    return Response(status_code=499) if body is None else body


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _invalid_json(reason: str) -> APIError:
    return APIError(400, f"the request body is not valid JSON: {reason}", None, "invalid_json")


async def _parse(request: Request, model: type[BaseModel]):
    """The JSON body (its Content-Type checked by ``RequestGuard``) as ``model``; 400s name the field."""
    raw = await request.body()
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:  # json's C scanner recurses once per nesting level
        raise _invalid_json("nested too deeply") from None
    except ValueError as e:  # also bad UTF-8 and integers past Python's 4300-digit limit
        raise _invalid_json(str(e)) from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, found {type(data).__name__}", None,
                       "invalid_value")
    path = _lone_surrogate(data)
    if path is not None:
        raise APIError(400, f"{path or 'a key'}: the string holds a lone UTF-16 surrogate (an unpaired "
                            "\\ud800-\\udfff escape), which is not text", path or None, "invalid_value")
    try:
        return model.model_validate(data)
    except RecursionError:
        raise _invalid_json("nested too deeply") from None
    except ValidationError as e:
        raise _validation_error(e.errors()) from None


_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins a valid pair into one character


def _lone_surrogate(data) -> str | None:
    """The path (``messages[0].content``) of a string in ``data`` holding a lone surrogate, which no
    encoder will write (the tokenizer or the JSON response would fail on it later); None if none."""
    todo = [(None, data)]  # a stack, not recursion: the document may nest as deep as json.loads allowed
    while todo:
        at, value = todo.pop()  # at: (parent's at, key or index), rendered only if needed
        if isinstance(value, str):
            if not value.isascii() and _SURROGATE.search(value):
                return _render(at)
        elif isinstance(value, dict):
            for key, item in value.items():
                if not key.isascii() and _SURROGATE.search(key):
                    return _render(at)
                todo.append(((at, key), item))
        elif isinstance(value, list):  # numbers skipped here: a prompt of token ids is a long list of them
            todo.extend(((at, i), item) for i, item in enumerate(value) if isinstance(item, (str, dict, list)))
    return None


def _render(at) -> str:
    parts = []
    while at is not None:
        at, key = at
        parts.append(f"[{key}]" if isinstance(key, int) else f".{key}")
    return "".join(reversed(parts)).lstrip(".")


def _validation_error(errors: list[dict]) -> APIError:
    """The first problem of a pydantic error list, as a 400 naming the field (``messages[0].role``).

    A value that fits none of a union's types (``prompt``, ``stop``) gives one error per type,
    all under the field's location: they become one message listing the accepted types."""
    locs = [[p for p in e.get("loc", ()) if p != "body"] for e in errors] or [[]]
    common = locs[0]
    for loc in locs[1:]:
        n = 0
        while n < min(len(common), len(loc)) and common[n] == loc[n]:
            n += 1
        common = common[:n]
    err = errors[0] if errors else {"msg": "invalid request"}
    union = len(errors) > 1 and bool(common)
    path = common if union else locs[0]
    param = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or None
    if err.get("type") == "missing" and not union:
        return APIError(400, f"{param}: this field is required", param, "missing_required_parameter")
    found = err.get("input")
    shown = "" if isinstance(found, (dict, list)) else f" (found {json.dumps(found)[:60]})"
    if union:
        kinds = sorted({str(loc[len(common)]) for loc in locs if len(loc) > len(common)})
        msg = f"expected one of: {', '.join(kinds)}"
    else:
        msg = err.get("msg", "invalid value")
    return APIError(400, f"{param + ': ' if param else ''}{msg}{shown}", param, "invalid_value")


class _CORS(CORSMiddleware):
    """Starlette's CORS, its refused preflight (an origin or header not allowed) in OpenAI's schema."""

    def preflight_response(self, request_headers) -> Response:
        response = super().preflight_response(request_headers)
        if response.status_code == 200:
            return response
        e = APIError(response.status_code, f"CORS preflight refused: {response.body.decode()} "
                                           "(see --allowed-origins)", None, "cors_refused")
        return JSONResponse(e.body(), status_code=e.status)


DOC_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


def build_app(serving: OpenAIServing, metrics: ServerMetrics | None = None, api_key: str | None = None,
              healthy: Callable[[], bool] = lambda: True, lifespan=None, limits: HttpLimits = HttpLimits(),
              allowed_origins: tuple[str, ...] = ()) -> FastAPI:
    """The OpenAI routes, /health and /metrics over ``serving``; ``limits`` on every request, CORS for
    ``allowed_origins`` only."""
    app = FastAPI(title="quill", version=__version__, lifespan=lifespan)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError):
        e = _validation_error(list(exc.errors()))
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException):
        e = APIError(exc.status_code, str(exc.detail), None, None)
        return JSONResponse(e.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

    if api_key:
        @app.middleware("http")
        async def _auth(request: Request, call_next):
            if request.url.path.startswith("/v1") or request.url.path in DOC_PATHS:
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                    e = APIError(401, "a valid API key is needed: send 'Authorization: Bearer <key>'", None,
                                 "invalid_api_key")
                    return JSONResponse(e.body(), status_code=401)
            return await call_next(request)

    app.add_middleware(RequestGuard, limits=limits)
    if allowed_origins:  # outermost: a preflight carries no API key and must not need one
        app.add_middleware(_CORS, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])

    @app.get("/health")
    async def health():
        ok = healthy()
        body = {"status": "ok" if ok else "unavailable"}
        engine = getattr(app.state, "engine", None)  # create_app's (the Ray ingress has none of its own)
        if not ok and engine is not None:
            body["reason"] = engine.down_reason  # e.g. "the engine failed: RuntimeError: ..."
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_route():
        if metrics is None:
            raise APIError(404, "this server keeps no metrics", None, "not_found")
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = await _parse(request, CompletionRequest)
        return await _answer(request, req.stream, serving.completions(req))

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        req = await _parse(request, ChatCompletionRequest)
        return await _answer(request, req.stream, serving.chat(req))

    responses = ResponsesServing(serving)

    @app.post("/v1/responses")
    async def responses_route(request: Request):
        req = await _parse(request, ResponsesRequest)
        return await _answer(request, req.stream, responses.create(req))

    return app


def default_model_name(path: str | os.PathLike) -> str:
    """A checkpoint's name as clients see it: its directory or file name without ``.gguf``."""
    name = os.path.basename(os.path.normpath(str(path)))
    return name[:-5] if name.endswith(".gguf") else name


def create_app(llm, config: ServeConfig = ServeConfig(), executor=None) -> FastAPI:
    """A server for a loaded ``quill.LLM``: its own ``AsyncEngine``, started and stopped by the app's lifespan.

    The engine steps on the server's event loop (load ``llm`` on the thread that will run the loop, as
    ``uvicorn.run`` in the same thread does); ``executor``: step on this one-thread executor instead, the
    one that loaded ``llm``."""
    name = config.model_name or default_model_name(llm.path)
    engine = AsyncEngine(llm, config.max_waiting, executor=executor, stream_interval=config.stream_interval,
                         on_loop=executor is None)
    metrics = ServerMetrics(engine.stats, name)
    engine.metrics = metrics
    serving = OpenAIServing(engine, llm.tokenizer, name, llm.context_length,
                            tool_call_parser=config.tool_call_parser, reasoning_parser=config.reasoning_parser)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = build_app(serving, metrics, config.api_key, lambda: engine.alive, lifespan, config.http_limits(),
                    config.allowed_origins)
    app.state.engine = engine
    return app
