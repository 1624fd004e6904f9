"""The HTTP host: a FastAPI app over ``OpenAIServing`` (routes, API key, errors, metrics, disconnects).

    app = create_app(llm, ServeConfig(api_key="sk-..."))     # owns an AsyncEngine started by the lifespan
    uvicorn.run(app, host="127.0.0.1", port=8000)

``build_app`` takes any ``OpenAIServing`` (the Ray ingress builds its own over replicas).
Every error is OpenAI's schema: invalid fields 400 (the field named), a missing or wrong
API key 401, an unknown model or route 404, a full queue 503 with ``Retry-After``.  A
client that goes away has its requests aborted, streamed or not.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException

from quill import __version__
from quill.serving.engine import AsyncEngine
from quill.serving.metrics import ServerMetrics
from quill.serving.openai import OpenAIServing
from quill.serving.protocol import APIError, ChatCompletionRequest, CompletionRequest

log = logging.getLogger("quill.serving")


@dataclass(frozen=True)
class ServeConfig:
    """Server options beyond the engine's (``EngineConfig``) and the model's."""

    model_name: str | None = None  # the name clients use; default: the checkpoint's file or directory name
    api_key: str | None = None  # when set, /v1/* needs "Authorization: Bearer <key>"
    max_waiting: int = 256  # requests queued beyond the running batch before 503
    stream_interval: int = 1  # tokens a streamed request gathers before they are sent (AsyncEngine)


class _EventStream(StreamingResponse):
    """An SSE response that closes its source however it ends (finished, client gone, never started)."""

    def __init__(self, source):
        super().__init__(source, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.source = source

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
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


async def _parse(request: Request, model: type[BaseModel]):
    """The JSON body as ``model`` whatever the Content-Type (curl -d sends a form type); 400s name the field."""
    raw = await request.body()
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON: {e}", None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(400, f"the request body must be a JSON object, found {type(data).__name__}", None,
                       "invalid_value")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise _validation_error(e.errors()) from None


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


def build_app(serving: OpenAIServing, metrics: ServerMetrics | None = None, api_key: str | None = None,
              healthy: Callable[[], bool] = lambda: True, lifespan=None) -> FastAPI:
    """The OpenAI routes, /health and /metrics over ``serving``."""
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
            if request.url.path.startswith("/v1"):
                given = request.headers.get("authorization", "")
                if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                    e = APIError(401, "a valid API key is needed: send 'Authorization: Bearer <key>'", None,
                                 "invalid_api_key")
                    return JSONResponse(e.body(), status_code=401)
            return await call_next(request)

    @app.get("/health")
    async def health():
        ok = healthy()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

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
    serving = OpenAIServing(engine, llm.tokenizer, name, llm.context_length)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.shutdown)

    app = build_app(serving, metrics, config.api_key, lambda: engine.alive, lifespan)
    app.state.engine = engine
    return app
