"""OpenAI response bodies: completion and chat completion objects, their stream chunks, logprobs, usage.

Plain dicts (serialised once with ``json.dumps``): a streamed token costs one small dict,
not a pydantic model.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from quill.engine.output import StreamChunk
from quill.engine.sampling import Logprob


def sse(obj) -> str:
    """One Server-Sent Event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass
class Choice:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[int, dict[int, Logprob]]] = field(default_factory=list)  # (sampled id, its dict)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, chunk: StreamChunk) -> None:
        self.text.append(chunk.text)
        if chunk.token_id is not None:
            self.token_ids.append(chunk.token_id)
            if chunk.logprobs is not None:
                self.logprobs.append((chunk.token_id, chunk.logprobs))
        if chunk.finish_reason is not None:
            self.finish_reason = finish_reason(chunk.finish_reason)
            self.stop_reason = chunk.stop_reason


def finish_reason(reason: str | None) -> str | None:
    """OpenAI's finish reason: "length", or "stop" (EOS, a stop token or string; an abort the client sees)."""
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"


@dataclass
class Usage:
    """Token counts of one response: each prompt once, every choice's completion, cached prompt tokens."""

    prompt: dict[int, int] = field(default_factory=dict)  # prompt index -> its length
    cached: dict[int, int] = field(default_factory=dict)
    completion: int = 0

    def add(self, prompt_index: int, chunk: StreamChunk) -> None:
        self.prompt[prompt_index] = chunk.num_prompt_tokens
        self.cached[prompt_index] = max(self.cached.get(prompt_index, 0), chunk.num_cached_tokens)
        self.completion += chunk.token_id is not None

    def body(self) -> dict:
        prompt = sum(self.prompt.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion,
                "total_tokens": prompt + self.completion,
                "prompt_tokens_details": {"cached_tokens": sum(self.cached.values())}}


def _token_text(lps: dict[int, Logprob], token: int) -> str:
    text = lps[token].decoded_token
    return text if text is not None else str(token)


# JSON has no -inf: a token the request's grammar or logit_bias rules out has log-prob -inf, sent as vLLM
# sends it (its OpenAI server clamps at this floor too)
LOGPROB_FLOOR = -9999.0


def _lp(entry: Logprob) -> float:
    return max(entry.logprob, LOGPROB_FLOOR)


def _top(lps: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k best-ranked entries (the sampled token's own entry is there only if it ranks within k)."""
    ranked = sorted(((t, lp) for t, lp in lps.items() if lp.rank is not None and lp.rank <= k),
                    key=lambda e: e[1].rank)
    return ranked[:k]


# ---- completions ------------------------------------------------------------------------------

def completion_logprobs(entries: list[tuple[int, dict[int, Logprob] | None]], offset: int, k: int,
                        decode: Callable[[int], str] = str) -> dict:
    """``{"tokens", "token_logprobs", "top_logprobs", "text_offset"}``; an entry's dict may be None (the first
    prompt token, which has no log-prob): its text is ``decode(token)``."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lps in entries:
        if lps is None:
            text, lp, top = decode(token), None, None
        else:
            text = _token_text(lps, token)
            lp = _lp(lps[token])
            top = {_token_text(lps, t): _lp(e) for t, e in _top(lps, k)}
            top.setdefault(text, lp)  # OpenAI: the sampled token is always there (up to k + 1 entries)
        out["tokens"].append(text)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(top)
        out["text_offset"].append(offset)
        offset += len(text)
    return out


def completion_body(rid: str, created: int, model: str, choices: list[dict], usage: Usage | None) -> dict:
    body = {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices}
    if usage is not None:
        body["usage"] = usage.body()
    return body


def completion_choice(index: int, text: str, logprobs: dict | None, finish: str | None,
                      stop_reason: int | str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish, "stop_reason": stop_reason}


# ---- chat -----------------------------------------------------------------------------------

def chat_logprobs(entries: list[tuple[int, dict[int, Logprob]]], k: int) -> dict:
    """``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}]}``."""
    content = []
    for token, lps in entries:
        text = _token_text(lps, token)
        top = [{"token": _token_text(lps, t), "logprob": _lp(e),
                "bytes": list(_token_text(lps, t).encode())} for t, e in _top(lps, k)]
        content.append({"token": text, "logprob": _lp(lps[token]), "bytes": list(text.encode()),
                        "top_logprobs": top})
    return {"content": content}


def chat_body(rid: str, created: int, model: str, choices: list[dict], usage: Usage) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model, "choices": choices,
            "usage": usage.body()}


def chat_choice(index: int, choice: Choice, k: int | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": "".join(choice.text)},
            "logprobs": chat_logprobs(choice.logprobs, k) if k is not None else None,
            "finish_reason": choice.finish_reason, "stop_reason": choice.stop_reason}


def chat_chunk(rid: str, created: int, model: str, choices: list[dict], usage: dict | None = None,
               with_usage: bool = False) -> dict:
    body = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices}
    if with_usage:
        body["usage"] = usage
    return body


def now() -> int:
    return int(time.time())
