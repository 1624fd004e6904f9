"""A load generator for OpenAI-compatible servers: closed-loop streaming clients, latency percentiles.

Each of C clients sends its next request when its previous one has finished, until the
workload is used up.  Every request streams ``/v1/completions`` (greedy, ``ignore_eos``,
so both sides generate exactly ``max_tokens``) and records when it was sent, when each
token chunk arrived, and how many tokens came back.  With ``chat=True`` each prompt is
instead one user message to ``/v1/chat/completions`` (greedy, ending where the answer ends,
at most ``max_tokens``), and the server's ``timings`` (llama-server's) are kept too.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

# Common English words: prompts are random sentences of them, so no two prompts share a prefix
# beyond a word or two and neither server gets prefix-cache hits the other does not.
WORDS = ("time person year way day thing man world life hand part child eye woman place work week case point "
         "government company number group problem fact be have do say get make go know take see come think look "
         "want give use find tell ask seem feel try leave call good new first last long great little own other "
         "old right big high different small large next early young important few public bad same able river "
         "mountain city garden window history music water light paper story market summer winter morning "
         "evening teacher doctor engine signal bridge forest island letter kitchen village").split()


@dataclass(frozen=True)
class Workload:
    """Requests as (prompt text, max_tokens), drawn once from a seed."""

    requests: tuple[tuple[str, int], ...]
    description: str

    @classmethod
    def random(cls, count: int, seed: int = 0, prompt_words: tuple[int, int] = (48, 192),
               output_tokens: tuple[int, int] = (32, 128)) -> "Workload":
        """``count`` prompts of uniform [a, b] words and outputs of uniform [c, d] tokens."""
        rng = random.Random(seed)
        reqs = []
        for i in range(count):
            n = rng.randint(*prompt_words)
            text = f"Request {i}: " + " ".join(rng.choice(WORDS) for _ in range(n)) + "."
            reqs.append((text, rng.randint(*output_tokens)))
        desc = (f"{count} requests, seed {seed}: prompts of uniform {prompt_words[0]}-{prompt_words[1]} random "
                f"English words, outputs of uniform {output_tokens[0]}-{output_tokens[1]} tokens (ignore_eos)")
        return cls(tuple(reqs), desc)


@dataclass
class Record:
    sent: float
    chunks: list[float] = field(default_factory=list)  # arrival of each chunk that carried a token
    tokens: int = 0
    error: str | None = None
    finished: float | None = None  # arrival of the chunk with the finish reason
    timings: dict = field(default_factory=dict)  # llama-server's per-request timings (its last chunk), if any

    @property
    def ttft(self) -> float | None:
        return self.chunks[0] - self.sent if self.chunks else None

    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunks, self.chunks[1:])]


@dataclass
class LoadResult:
    clients: int
    wall: float
    records: list[Record]

    def summary(self) -> dict:
        ok = [r for r in self.records if r.error is None]
        out_tokens = sum(r.tokens for r in ok)
        ttfts = sorted(r.ttft for r in ok if r.ttft is not None)
        itls = sorted(x for r in ok for x in r.itls())
        return {"clients": self.clients, "requests": len(ok), "errors": len(self.records) - len(ok),
                "wall_s": self.wall, "output_tok_s": out_tokens / self.wall if self.wall else 0.0,
                "requests_s": len(ok) / self.wall if self.wall else 0.0,
                "ttft_p50_ms": 1e3 * _pct(ttfts, 50), "ttft_p99_ms": 1e3 * _pct(ttfts, 99),
                "itl_p50_ms": 1e3 * _pct(itls, 50), "itl_p99_ms": 1e3 * _pct(itls, 99),
                "output_tokens": out_tokens,
                "first_error": next((r.error for r in self.records if r.error is not None), None)}


def _pct(sorted_values: list[float], p: float) -> float:
    if not sorted_values:
        return float("nan")
    if len(sorted_values) == 1:
        return sorted_values[0]
    return statistics.quantiles(sorted_values, n=100, method="inclusive")[min(98, max(0, int(p) - 1))]


async def _one(http, model: str, prompt: str, max_tokens: int, extra: dict, chat: bool = False) -> Record:
    import httpx

    if chat:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
                "temperature": 0.0, "stream": True, "stream_options": {"include_usage": True}, **extra}
    else:
        body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
                "stream_options": {"include_usage": True}, "ignore_eos": True, **extra}
    for _ in range(2):
        rec = await _attempt(http, body, chat)
        # A kept-alive connection the server had closed (cpp-httplib, llama-server's HTTP layer,
        # closes one after 5 requests) fails before any response: send again, as browsers do.
        if not (not rec.chunks and rec.error and rec.error.startswith(httpx.RemoteProtocolError.__name__)):
            break
    return rec


async def _attempt(http, body: dict, chat: bool = False) -> Record:
    rec = Record(time.monotonic())
    try:
        async with http.stream("POST", "/v1/chat/completions" if chat else "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                rec.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return rec
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line.strip() == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                choices = event.get("choices") or ()
                now = time.monotonic()
                # completions: a chunk per generated token; llama-server adds a last one with only the finish
                # reason.  Chat: a chunk with text (the first, the role alone, comes before any token)
                if any((c.get("delta") or {}).get("content") if chat else
                       (c.get("text") or c.get("finish_reason") is None) for c in choices):
                    rec.chunks.append(now)
                if any(c.get("finish_reason") is not None for c in choices):
                    rec.finished = now
                if event.get("usage"):
                    rec.tokens = event["usage"]["completion_tokens"]
                if event.get("timings"):
                    rec.timings = event["timings"]
            if not rec.tokens:
                rec.error = "no usage reported"
    except Exception as e:  # noqa: BLE001 - any transport failure is a failed request, counted, not fatal
        rec.error = f"{type(e).__name__}: {e}"
    return rec


async def run_load(base_url: str, model: str, workload: Workload, clients: int, api_key: str | None = None,
                   extra: dict | None = None, chat: bool = False) -> LoadResult:
    """Run ``workload`` through ``clients`` closed-loop clients against ``base_url`` (no /v1); ``chat``: each
    prompt as a user message to /v1/chat/completions (no ``ignore_eos``)."""
    import httpx

    queue = list(workload.requests)
    records: list[Record] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def client(http):
        while queue:
            prompt, n = queue.pop(0)
            records.append(await _one(http, model, prompt, n, extra or {}, chat))

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(600.0), headers=headers,
                                 limits=limits) as http:
        start = time.monotonic()
        await asyncio.gather(*[client(http) for _ in range(clients)])
        wall = time.monotonic() - start
    return LoadResult(clients, wall, records)
