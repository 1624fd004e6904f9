"""``quill serve``'s HTTP front against hostile or broken clients (issue 41): body size and time, header
time, malformed JSON, lone surrogates, Content-Type, Host, CORS, the docs behind the key.

One live server with the default options (no API key: the case a web page could drive) and short
timeouts, talked to with httpx and, to dribble, raw sockets.  After each attack the server must still
be healthy and give the offline greedy answer (``LLM.generate`` on the same model in this process).
"""

from __future__ import annotations

import asyncio
import json
import select
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

import quill
from tests.server_util import ServerProcess

JSON = {"Content-Type": "application/json"}
PROMPT = "The capital of France is"
MB = 1024 * 1024


@pytest.fixture(scope="module")
def server():
    # --header-timeout 3, not 1: once, on a loaded 2-core machine, a well-formed request's connection closed
    # without an answer, most likely at this deadline (the log that would say was not kept)
    with ServerProcess("--max-num-seqs", "4", "--header-timeout", "3", "--body-timeout", "10") as s:
        yield s


@pytest.fixture(scope="module")
def llm():
    return quill.LLM()


@pytest.fixture(scope="module")
def greedy(llm) -> str:
    return llm.generate(PROMPT, quill.SamplingParams(max_tokens=8, temperature=0.0))[0].text


def assert_serving(server, greedy: str) -> None:
    assert httpx.get(server.url + "/health", timeout=30).status_code == 200
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                   timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == greedy


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json")
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code, err
    assert err["param"] == param, err
    return err


def host_port(server) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def closed(sock: socket.socket) -> bool:
    """Whether the server has closed the connection (without waiting)."""
    if not select.select([sock], [], [], 0)[0]:
        return False
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def read_all(sock: socket.socket, limit: float) -> bytes:
    """What the server sends until it closes the connection (or ``limit`` seconds pass)."""
    sock.settimeout(limit)
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except ConnectionResetError:
        pass
    return out


# ---- body size --------------------------------------------------------------------------------------

async def _stream_times(http: httpx.AsyncClient, times: list[float], max_tokens: int = 60) -> str:
    body = {"prompt": "Write a long story about a dragon.", "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    text = []
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        assert resp.status_code == 200
        async for line in resp.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:])["choices"][0]["text"])
                times.append(time.monotonic())
    return "".join(text)


def test_10mb_body_is_413_while_another_client_streams(server, llm, greedy):
    """10 MB bodies are refused with 413 from their Content-Length, never parsed; a streaming client meanwhile
    keeps getting tokens (before: every client froze ~45 s while such a body was tokenized)."""
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            times: list[float] = []
            stream = asyncio.create_task(_stream_times(http, times))
            while len(times) < 3:
                await asyncio.sleep(0.01)
            start = time.monotonic()
            big = b'{"prompt": "' + b"a" * (10 * MB) + b'"}'
            answers = [await http.post("/v1/completions", content=big, headers=JSON) for _ in range(3)]
            end = time.monotonic()
            return answers, start, end, times, await stream

    answers, start, end, times, text = asyncio.run(main())
    for r in answers:
        assert "10485774 bytes" in assert_error(r, 413, "request_too_large")["message"]
    offline = llm.generate("Write a long story about a dragon.",
                           quill.SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True))[0].text
    assert text == offline
    # the stream went on while the uploads were refused: it outlived them, or ended during them where the
    # uploads were slow (seen on a loaded machine: 60 tokens done 0.08 s before the third 413) ...
    assert times[-1] > end or sum(start < t < end for t in times) >= 5, (start, end, times)
    gaps = [b - a for a, b in zip(times, times[1:]) if b > start and a < end]
    assert gaps and max(gaps) < 10.0, gaps  # ... and was never held up for long by them
    assert_serving(server, greedy)


def test_a_long_prompt_is_tokenized_while_another_client_streams(server, llm, greedy):
    """A 6 MB prompt (under the body limit) is tokenized off the event loop with the GIL released: a
    streaming client keeps getting tokens meanwhile (tokenized on the loop, or on a thread holding the GIL,
    every client froze for the whole encode, ~1.5 s per MB here), then the prompt gets its 400."""
    prompt = "hello world " * (MB // 2)  # 6 MB, 1M tokens
    n = 200

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            times: list[float] = []
            stream = asyncio.create_task(_stream_times(http, times, n))
            while len(times) < 3:
                await asyncio.sleep(0.01)
            start = time.monotonic()
            answer = await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})
            end = time.monotonic()
            return answer, start, end, times, await stream

    answer, start, end, times, text = asyncio.run(main())
    assert "longer than the context window" in assert_error(answer, 400, "invalid_value", "prompt")["message"]
    offline = llm.generate("Write a long story about a dragon.",
                           quill.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True))[0].text
    assert text == offline
    # the stream, alive when the encode began, was never held up for the length of it (>= 8 s of one core)
    gaps = [b - a for a, b in zip(times, times[1:]) if b > start and a < end]
    assert gaps and max(gaps) < (end - start) / 3, (max(gaps), end - start)
    assert_serving(server, greedy)


async def _chunks(n: int):
    for _ in range(n):
        yield b"a" * MB


def test_chunked_body_is_413_once_past_the_limit(server, greedy):
    """Without a Content-Length (chunked), the body is counted as it comes: 413 once past 8 MiB."""
    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await http.post("/v1/completions", content=_chunks(10), headers=JSON)

    err = assert_error(asyncio.run(main()), 413, "request_too_large")
    assert "at least" in err["message"] and str(8 * MB) in err["message"]
    assert_serving(server, greedy)


# ---- malformed JSON -----------------------------------------------------------------------------------

BAD_JSON = [
    ("/v1/completions", b'{"prompt": "caf\xe9"}', None, "invalid_json"),  # Latin-1, not UTF-8
    # a surrogate encoded as UTF-8: invalid UTF-8, but json.loads decodes bytes with 'surrogatepass'
    ("/v1/completions", b'{"prompt": "\xed\xa0\x80"}', "prompt", "invalid_value"),
    ("/v1/completions", b'{"prompt": "x\\ud800"}', "prompt", "invalid_value"),
    ("/v1/completions", b'{"prompt": ["fine", "\\udfff and"]}', "prompt[1]", "invalid_value"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi \\ud83d"}]}', "messages[0].content",
     "invalid_value"),
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ude00"}]}]}',
     "messages[0].content[0].text", "invalid_value"),
    ("/v1/completions", b'{"prompt": "x", "user": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", None, "invalid_json"),
    ("/v1/completions", b'{"prompt": [' + b"7" * 5000 + b"]}", None, "invalid_json"),  # past int's digit limit
    ("/v1/completions", b'{"prompt": "x", "temperature": NaN}', None, "invalid_json"),
]


@pytest.mark.parametrize("path,body,param,code", BAD_JSON, ids=[f"{i}-{b[3]}" for i, b in enumerate(BAD_JSON)])
def test_malformed_json_is_400_in_openai_schema(server, greedy, path, body, param, code):
    err = assert_error(httpx.post(server.url + path, content=body, headers=JSON, timeout=60), 400, code, param)
    if param:
        assert err["message"].startswith(param) and "surrogate" in err["message"]
    assert_serving(server, greedy)


def test_a_valid_surrogate_pair_is_text(server):
    """``\\ud83d\\ude00`` is one character (an emoji): accepted, and answered as UTF-8."""
    r = httpx.post(server.url + "/v1/completions", content=b'{"prompt": "\\ud83d\\ude00 means", "max_tokens": 2}',
                   headers=JSON, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


# ---- Content-Type, Host, CORS -------------------------------------------------------------------------

@pytest.mark.parametrize("content_type", [None, "text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x"])
def test_json_endpoints_need_a_json_content_type(server, greedy, content_type):
    """What a cross-site form or fetch without a preflight can send is refused before it is read."""
    headers = {} if content_type is None else {"Content-Type": content_type}
    body = json.dumps({"prompt": PROMPT, "max_tokens": 8, "temperature": 0}).encode()
    for path in ("/v1/completions", "/v1/chat/completions"):
        err = assert_error(httpx.post(server.url + path, content=body, headers=headers, timeout=60), 415,
                           "unsupported_media_type")
        assert "application/json" in err["message"]
    with_charset = httpx.post(server.url + "/v1/completions", content=body, timeout=120,
                              headers={"Content-Type": "Application/JSON; charset=utf-8"})
    assert with_charset.status_code == 200 and with_charset.json()["choices"][0]["text"] == greedy
    assert_serving(server, greedy)


def test_a_foreign_host_is_refused(server, greedy):
    """A page that rebinds its own name to 127.0.0.1 still sends its name as Host."""
    _, port = host_port(server)
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0}
    for host in ("evil.example", f"evil.example:{port}", "127.0.0.1.evil.example", "192.168.1.10"):
        err = assert_error(httpx.post(server.url + "/v1/completions", json=body, headers={"Host": host}), 400,
                           "invalid_host")
        assert "invalid host" in err["message"]
        assert_error(httpx.get(server.url + "/v1/models", headers={"Host": host}), 400, "invalid_host")
    for host in ("localhost", f"localhost:{port}", "127.0.0.1", f"127.0.0.1:{port}", f"[::1]:{port}"):
        r = httpx.post(server.url + "/v1/completions", json=body, headers={"Host": host}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == greedy, host
    assert_serving(server, greedy)


def test_cors_is_off_without_allowed_origins(server, greedy):
    origin = {"Origin": "https://some.page.example"}
    pre = httpx.options(server.url + "/v1/chat/completions", headers={
        **origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "content-type"})
    assert pre.status_code >= 400 and "access-control-allow-origin" not in pre.headers
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                   headers=origin, timeout=120)
    assert "access-control-allow-origin" not in r.headers  # answered, but no page may read it
    assert_serving(server, greedy)


def test_docs_open_without_a_key(server):
    assert httpx.get(server.url + "/openapi.json").json()["info"]["title"] == "quill"


# ---- slow clients -------------------------------------------------------------------------------------

def test_dribbled_headers_are_dropped(server, greedy):
    """--header-timeout 3: a client that sends its headers a byte at a time, or nothing, is disconnected."""
    host, port = host_port(server)
    with socket.create_connection((host, port)) as idle, socket.create_connection((host, port)) as slow:
        start = time.monotonic()
        request = f"GET /health HTTP/1.1\r\nHost: {host}\r\nX-Slow: ".encode() + b"z" * 1000
        for byte in request:  # 20 bytes a second: the headers would take a minute
            try:
                slow.sendall(bytes([byte]))
            except OSError:  # closed under it: a reset or a broken pipe
                break
            if closed(slow):
                break
            time.sleep(0.05)
        took = time.monotonic() - start
        assert 2.9 < took < 8, took
        assert read_all(idle, 5) == b""  # an idle connection that never sent a request: closed, no answer
    assert_serving(server, greedy)


def test_dribbled_body_is_408_and_closed(server, greedy):
    """--body-timeout 10: a body that has not arrived 10 s after its headers gets 408 and the connection closes
    (10, not less: a 6 MB body a test sends whole takes seconds to read on a loaded 2-core machine)."""
    host, port = host_port(server)
    with socket.create_connection((host, port)) as sock:
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     "Content-Length: 200\r\n\r\n{\"prompt\": ".encode())
        start = time.monotonic()
        for _ in range(6):  # a byte now and then: still far from the whole body when the time is up
            time.sleep(0.4)
            sock.sendall(b" ")
        answer = read_all(sock, 20)
        took = time.monotonic() - start
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408") and b"connection: close" in head.lower(), answer
    err = json.loads(body)["error"]
    assert err["code"] == "request_timeout" and "--body-timeout" in err["message"]
    assert 9.5 < took < 20, took
    assert_serving(server, greedy)


def test_size_refused_from_content_length_before_the_body(server, greedy):
    """Content-Length past the limit: 413 at once, before the body; the rest of the body is read and dropped
    for --body-timeout (10 s) so a client still sending can read the answer, then the connection closes."""
    host, port = host_port(server)
    with socket.create_connection((host, port)) as sock:
        start = time.monotonic()
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                     f"Content-Length: {64 * 1024 ** 3}\r\n\r\n".encode() + b"a" * MB)
        sock.settimeout(10)
        answer = b""
        while b"}}" not in answer and (chunk := sock.recv(65536)):
            answer += chunk
        answered = time.monotonic() - start
        sock.sendall(b"a" * MB)  # still read (and dropped) after the answer
        assert read_all(sock, 20) == b""
        dropped = time.monotonic() - start
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), answer
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert answered < 2 and 9.9 < dropped < 20, (answered, dropped)
    assert_serving(server, greedy)


def test_bytes_that_are_not_http_get_a_json_400(server, greedy):
    host, port = host_port(server)
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"HELLO\x00 there\r\n\r\n")
        answer = read_all(sock, 10)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400") and b"application/json" in head, answer
    assert json.loads(body)["error"]["code"] == "invalid_http"
    assert_serving(server, greedy)


# ---- a server with a key and allowed origins ---------------------------------------------------------

def test_key_guards_the_docs_and_allowed_origins_get_cors(greedy):
    key = {"Authorization": "Bearer sk-test"}
    page = "https://app.example"
    with ServerProcess("--api-key", "sk-test", "--allowed-origins", f"{page},http://localhost:3000",
                       "--max-num-seqs", "1") as s:
        for path in ("/docs", "/redoc", "/openapi.json"):
            assert_error(httpx.get(s.url + path), 401, "invalid_api_key")
            assert httpx.get(s.url + path, headers=key).status_code == 200, path
        ask = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization,content-type"}
        pre = httpx.options(s.url + "/v1/completions", headers={"Origin": page, **ask})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == page
        refused = httpx.options(s.url + "/v1/completions", headers={"Origin": "https://other.example", **ask})
        assert_error(refused, 400, "cors_refused")
        assert "access-control-allow-origin" not in refused.headers
        r = httpx.post(s.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0},
                       headers={"Origin": page, **key}, timeout=120)
        assert r.headers["access-control-allow-origin"] == page
        assert r.json()["choices"][0]["text"] == greedy


def test_http_flags_are_checked_before_the_model_loads():
    run = lambda *a: subprocess.run([sys.executable, "-m", "quill", "serve", "--port", "0", *a],  # noqa: E731
                                    capture_output=True, text=True, timeout=120)
    r = run("--max-body-size", "lots")
    assert r.returncode != 0 and "--max-body-size: expected bytes such as 2GiB" in r.stderr and "'lots'" in r.stderr
    r = run("--header-timeout", "0")
    assert r.returncode != 0 and "--header-timeout: expected seconds > 0, found 0.0" in r.stderr
    r = run("--replicas", "2", "--allowed-origins", "https://app.example", "--body-timeout", "5")
    assert r.returncode != 0 and "--body-timeout, --allowed-origins: not available with replicas" in r.stderr


# ---- an exception nobody expected ---------------------------------------------------------------------

class _BrokenEngine:
    """Takes a prompt, then fails on submit with an exception no layer below the app turns into an answer."""

    def check(self, ids, *label_and_params):
        return list(ids)

    def submit(self, requests, **hints):
        raise RuntimeError("a bug in the engine")


def test_an_unexpected_exception_is_a_logged_500_in_openai_schema(caplog):
    """The app over a broken engine, on uvicorn with quill's protocol: 500 ``server_error``, traceback logged."""
    import uvicorn

    from quill.serving.app import build_app
    from quill.serving.http_limits import protocol_class
    from quill.serving.openai import OpenAIServing

    app = build_app(OpenAIServing(_BrokenEngine(), None, "m", 4096))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", http=protocol_class(5.0)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    url = "http://127.0.0.1:%d" % sock.getsockname()[1]
    try:
        while not server.started:
            time.sleep(0.05)
        with caplog.at_level("ERROR", logger="quill.serving"):
            r = httpx.post(url + "/v1/completions", json={"prompt": [1, 2, 3], "max_tokens": 2}, timeout=30)
        err = assert_error(r, 500)
        assert err["type"] == "server_error"
        assert any(rec.exc_info and "a bug in the engine" in str(rec.exc_info[1]) for rec in caplog.records)
        assert httpx.get(url + "/health").status_code == 200
    finally:
        server.should_exit = True
        thread.join(10)
