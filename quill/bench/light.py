"""A streaming reader that costs the host next to nothing, for the server's own decode rate.

On a 2-core host the load generator (``quill.bench.load``: httpx, one ``json.loads`` per
event) runs on the same cores as the server's two compute threads, and every time it
wakes it takes a core from one of them: the measured single-client rate then includes
the client's own parsing.  This reader does one blocking ``recv`` per arrival and keeps
the bytes with their arrival times; the HTTP chunked framing and the SSE events are
parsed after the stream has ended, so what it measures is the server.

    rec = stream_once("http://127.0.0.1:8000", "model", "Hello", 64)   # a load.Record
"""

from __future__ import annotations

import json
import socket
import time
from urllib.parse import urlsplit

from quill.bench.load import Record


def stream_once(base_url: str, model: str, prompt: str, max_tokens: int, api_key: str | None = None,
                timeout: float = 600.0) -> Record:
    """One greedy streamed ``/v1/completions`` request; ``chunks`` holds each token event's arrival time."""
    url = urlsplit(base_url)
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                       "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}).encode()
    head = (f"POST {url.path.rstrip('/')}/v1/completions HTTP/1.1\r\nHost: {url.hostname}\r\n"
            "Content-Type: application/json\r\nConnection: close\r\n"
            + (f"Authorization: Bearer {api_key}\r\n" if api_key else "")
            + f"Content-Length: {len(body)}\r\n\r\n").encode()
    rec = Record(time.monotonic())
    arrivals: list[tuple[float, int]] = []  # (time, raw byte count so far)
    raw = bytearray()
    try:
        with socket.create_connection((url.hostname, url.port or 80), timeout=timeout) as s:
            s.sendall(head + body)
            while True:
                data = s.recv(1 << 16)
                if not data:
                    break
                raw += data
                arrivals.append((time.monotonic(), len(raw)))
    except OSError as e:
        rec.error = f"{type(e).__name__}: {e}"
        return rec
    _parse(bytes(raw), arrivals, rec)
    return rec


def _parse(raw: bytes, arrivals: list[tuple[float, int]], rec: Record) -> None:
    """Fill ``rec`` from the whole response: status, chunked body, one time per token event."""
    header_end = raw.find(b"\r\n\r\n")
    if header_end < 0:
        rec.error = "no HTTP response"
        return
    status = raw[:raw.find(b"\r\n")].split()
    if len(status) < 2 or status[1] != b"200":
        rec.error = f"HTTP {raw[:200]!r}"
        return
    chunked = b"transfer-encoding: chunked" in raw[:header_end].lower()
    text, ends = _body(raw, header_end + 4, chunked)
    pos = 0
    for event in text.split(b"\n\n"):
        pos += len(event) + 2
        line = event.strip()
        if not line.startswith(b"data: ") or line == b"data: [DONE]":
            continue
        obj = json.loads(line[6:])
        if any(c.get("text") or c.get("finish_reason") is None for c in obj.get("choices") or ()):
            rec.chunks.append(_arrival(_raw_offset(ends, pos), arrivals))
        if obj.get("usage"):
            rec.tokens = obj["usage"]["completion_tokens"]
    if not rec.tokens:
        rec.error = "no usage reported"


def _body(raw: bytes, start: int, chunked: bool) -> tuple[bytes, list[tuple[int, int]]]:
    """The body's bytes and, per piece, (body offset after it, raw offset after it)."""
    if not chunked:
        return raw[start:], [(len(raw) - start, len(raw))]
    out, ends, i = bytearray(), [], start
    while i < len(raw):
        eol = raw.find(b"\r\n", i)
        if eol < 0:
            break
        size = int(raw[i:eol].split(b";")[0], 16)
        if size == 0:
            break
        out += raw[eol + 2:eol + 2 + size]
        i = eol + 2 + size + 2
        ends.append((len(out), i - 2))
    return bytes(out), ends


def _raw_offset(ends: list[tuple[int, int]], body_pos: int) -> int:
    """Where in the raw stream the body byte before ``body_pos`` arrived."""
    for body_end, raw_end in ends:
        if body_pos <= body_end:
            return raw_end
    return ends[-1][1] if ends else 0


def _arrival(raw_pos: int, arrivals: list[tuple[float, int]]) -> float:
    for t, received in arrivals:
        if received >= raw_pos:
            return t
    return arrivals[-1][0]
