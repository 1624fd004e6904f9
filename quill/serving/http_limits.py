"""What one HTTP request may cost ``quill serve`` before it is admitted, and who may send it.

* ``RequestGuard`` (pure ASGI, outside the routes): the Host header against the names the server
  answers to (a page on another site reached through DNS rebinding sends its own), a JSON
  Content-Type on ``POST /v1/*`` (a cross-site form or ``text/plain`` post cannot send one without a
  CORS preflight), the body size (413 at once from Content-Length, or as soon as a streamed body
  passes the limit, never buffered past it) and time (408 when it has not arrived within
  ``body_timeout``), and a last catch: an unexpected exception is a logged 500 in OpenAI's schema.
* ``protocol_class``: uvicorn's HTTP/1.1 protocol with a deadline on the request's headers, which
  uvicorn has none of (a client that sends them a byte at a time holds a connection forever), and
  on the rest of a body answered before it was read (a 413): uvicorn reads and drops it so that the
  client, which may be still sending, can read the answer (closing on unread data sends a TCP reset
  that destroys it), but would do so for as long as the client keeps sending.

Errors are ``APIError`` bodies.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass

import h11  # uvicorn's own dependency
from starlette.requests import ClientDisconnect
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from quill.serving.protocol import APIError

log = logging.getLogger("quill.serving")

LOCAL_HOSTS = frozenset({"localhost", "127.0.0.1", "::1"})
_WILDCARD = ("", "0.0.0.0", "::")


@dataclass(frozen=True)
class HttpLimits:
    max_body_size: int = 8 * 1024 * 1024  # bytes; a chat of a full 128k-token context is ~0.5-1 MB of JSON
    body_timeout: float = 30.0  # seconds from the request's headers to the end of its body
    allowed_hosts: frozenset[str] | None = None  # Host names answered (without port); None: any


def allowed_hosts(bound: str | None, extra: tuple[str, ...] = ()) -> frozenset[str] | None:
    """The Host names a server bound to ``bound`` answers to: loopback names, the bound address and
    ``extra``; None (any) if ``extra`` has ``*``, or when bound to every interface with no ``extra``
    (its clients may call the machine by any of its names)."""
    names = {h.strip().lower().strip("[]") for h in extra if h.strip()}
    if "*" in names:
        return None
    if bound is None or bound in _WILDCARD:
        return frozenset(LOCAL_HOSTS | names) if names else None
    return frozenset(LOCAL_HOSTS | names | {bound.lower()})


def host_name(header: str) -> str:
    """'Example.com:8000' -> 'example.com', '[::1]:8000' -> '::1'."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:header.find("]")] if "]" in header else header
    return header.rsplit(":", 1)[0] if header.count(":") == 1 else header


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope["headers"]:
        if key == name:
            return value.decode("latin-1")
    return None


async def send_error(send: Send, error: APIError) -> None:
    data = json.dumps(error.body()).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in (error.headers or {}).items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": data})


class _Body:
    """The request's ``receive``, counting and timing the body until its last part has arrived."""

    def __init__(self, receive: Receive, limits: HttpLimits, expected: bool):
        self._receive, self.limits = receive, limits
        self.finished = not expected
        self.size = 0
        self.deadline = asyncio.get_running_loop().time() + limits.body_timeout

    async def receive(self) -> Message:
        if self.finished:  # only http.disconnect can come now: wait as long as the handler likes
            return await self._receive()
        remaining = self.deadline - asyncio.get_running_loop().time()
        try:
            message = await asyncio.wait_for(self._receive(), max(remaining, 0.0))
        except asyncio.TimeoutError:
            raise APIError(408, f"the request body did not arrive within {self.limits.body_timeout:g} s "
                                f"(--body-timeout); {self.size} bytes came", None, "request_timeout",
                           headers={"Connection": "close"}) from None  # a client this slow is not waited for
        if message["type"] == "http.request":
            self.size += len(message.get("body", b""))
            if self.size > self.limits.max_body_size:
                raise _too_large(f"at least {self.size}", self.limits.max_body_size)
            self.finished = not message.get("more_body", False)
        return message


def _too_large(size: str, limit: int) -> APIError:
    return APIError(413, f"the request body is {size} bytes; this server takes at most {limit} bytes "
                         "(--max-body-size)", None, "request_too_large")


class RequestGuard:
    """The checks of a request before the routes see it, and the 500 of last resort (see the module)."""

    def __init__(self, app: ASGIApp, limits: HttpLimits):
        self.app, self.limits = app, limits

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is not None:
            await send_error(send, refusal)
            return
        length, chunked = _header(scope, b"content-length"), _header(scope, b"transfer-encoding")
        body = _Body(receive, self.limits, expected=bool(chunked) or (length not in (None, "0")))
        started = False

        async def send_marked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, body.receive, send_marked)
        except ClientDisconnect:
            pass  # the client left while sending its body: nobody to answer
        except APIError as e:  # raised outside any route (a route's are answered by the app's handler)
            if not started:
                await send_error(send, e)
        except Exception as e:
            log.exception("unexpected error answering %s %s", scope.get("method"), scope.get("path"))
            if not started:
                await send_error(send, APIError(500, f"the server failed on this request ({type(e).__name__}); "
                                                     "its log has the details", None, "internal_error",
                                                "server_error"))

    def refusal(self, scope: Scope) -> APIError | None:
        """Why the request is refused on its headers alone, if it is."""
        allowed = self.limits.allowed_hosts
        if allowed is not None:
            host = _header(scope, b"host") or ""
            if host_name(host) not in allowed:
                return APIError(400, f"invalid host '{host}': this server answers to {', '.join(sorted(allowed))} "
                                     "(more with --allowed-hosts)", None, "invalid_host")
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limits.max_body_size:
            return _too_large(length, self.limits.max_body_size)
        if scope["method"] == "POST" and scope["path"].startswith("/v1/"):
            kind = (_header(scope, b"content-type") or "").split(";")[0].strip().lower()
            if kind != "application/json":
                return APIError(415, f"Content-Type must be application/json, found '{kind or 'none'}' (with "
                                     "curl: -H 'Content-Type: application/json')", None, "unsupported_media_type")
        return None


class _Deadlines:
    """Closes the connection when a request's headers are not complete ``header_timeout`` seconds after
    the connection opened or the request's first byte came (idle keep-alive is uvicorn's own timeout),
    or when the rest of a body answered early has not come ``drain_timeout`` seconds after the answer."""

    header_timeout: float = 10.0
    drain_timeout: float = 30.0

    def _arm(self, kind: str) -> None:
        timers = self.__dict__.setdefault("_timers", {})
        if kind not in timers and not self.transport.is_closing():
            seconds = self.header_timeout if kind == "headers" else self.drain_timeout
            timers[kind] = self.loop.call_later(seconds, self._expire, kind, seconds)

    def _disarm(self, kind: str) -> None:
        timer = self.__dict__.get("_timers", {}).pop(kind, None)
        if timer is not None:
            timer.cancel()

    def _expire(self, kind: str, seconds: float) -> None:
        self._timers.pop(kind, None)
        what = "its request headers" if kind == "headers" else "the rest of a request body answered early"
        log.info("closing the connection from %s: %s took longer than %g s", self.client, what, seconds)
        self.transport.close()  # no response: there is no request to answer, or it was answered

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self._arm("headers")

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to bytes that are not HTTP (its text/plain), in OpenAI's schema; then close."""
        body = json.dumps(APIError(400, msg, None, "invalid_http").body()).encode()
        self.transport.write(b"HTTP/1.1 400 Bad Request\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()

    def connection_lost(self, exc) -> None:
        self._disarm("headers")
        self._disarm("drain")
        super().connection_lost(exc)


class _HttpToolsDeadlines(_Deadlines):
    _body_pending = False

    def on_message_begin(self) -> None:  # a request's first byte
        super().on_message_begin()
        self._arm("headers")

    def on_headers_complete(self) -> None:
        self._disarm("headers")
        self._body_pending = True
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._body_pending = False
        self._disarm("drain")
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self._body_pending:  # answered before its body was read: uvicorn drops the rest as it comes
            self._arm("drain")


class _H11Deadlines(_Deadlines):
    def handle_events(self) -> None:
        super().handle_events()
        # h11 holds a request back until its headers are whole: IDLE with bytes buffered
        if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
            self._arm("headers")
        elif self.conn.their_state is not h11.IDLE:
            self._disarm("headers")
        self._check_drain()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._check_drain()

    def _check_drain(self) -> None:
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.SEND_BODY:
            self._arm("drain")
        else:
            self._disarm("drain")


def protocol_class(header_timeout: float, drain_timeout: float = 30.0) -> type[asyncio.Protocol]:
    """The protocol uvicorn's ``http="auto"`` would pick (httptools when installed, else h11) with the
    deadlines of ``_Deadlines``: ``uvicorn.Config(app, http=protocol_class(10.0, 30.0))``."""
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    mixin = _HttpToolsDeadlines if AutoHTTPProtocol.__name__ == "HttpToolsProtocol" else _H11Deadlines
    return type("Protocol", (mixin, AutoHTTPProtocol),
                {"header_timeout": header_timeout, "drain_timeout": drain_timeout})
