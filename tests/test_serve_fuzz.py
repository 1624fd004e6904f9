"""Property-based fuzzing of a live ``quill serve`` (the default model): its OpenAI endpoints must answer
every request with a status below 500 (a 503 "server busy" aside) and every error in OpenAI's schema,
and keep serving afterwards.

Requests come from three sources, all sent as raw JSON bytes (``NaN``, lone surrogates, big integers
pass through as a careless client would send them):

* schemathesis over the server's own OpenAPI schema (``/openapi.json``), valid and invalid bodies.  The
  routes read their bodies themselves (``quill.serving.app._parse``), so where the schema does not
  describe a body, the pydantic model the route parses (``CompletionRequest``, ``ChatCompletionRequest``)
  does, through its ``model_json_schema()``;
* hypothesis mutations of valid bodies: a field (or a nested one) set to a wrong type, a huge, negative,
  tiny or NaN-like number, an unknown token id, a lone surrogate, deep nesting, or removed;
* a fixed list of such bodies, each its own test case.

Generation is kept cheap (at most 4 new tokens and 4 choices per request, however the body asks for more:
``_bounded``), so a run is a few hundred requests in well under a minute on 2 cores.
"""

from __future__ import annotations

import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, Phase, assume, given, settings
from hypothesis import strategies as st
from server_util import ServerProcess

from quill.serving.protocol import ChatCompletionRequest, CompletionRequest

schemathesis = pytest.importorskip("schemathesis")

ROUTES = {"/v1/completions": CompletionRequest, "/v1/chat/completions": ChatCompletionRequest}
MAX_NEW, MAX_N = 4, 4
HUGE = 100_000  # above this a token count is a context-window error, never generated: kept as sent
FUZZ = settings(deadline=None, database=None, suppress_health_check=list(HealthCheck),
                phases=[Phase.explicit, Phase.generate, Phase.shrink])


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "4", "--no-cache") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c


# ---- what every answer must look like ------------------------------------------------------------
def _error_schema_problem(body) -> str | None:
    """Why ``body`` is not OpenAI's error schema, or None."""
    if not isinstance(body, dict) or set(body) != {"error"} or not isinstance(body["error"], dict):
        return "not {'error': {...}}"
    err = body["error"]
    if set(err) != {"message", "type", "param", "code"}:
        return f"error keys {sorted(err)}, not message, type, param, code"
    if not isinstance(err["message"], str) or not err["message"] or not isinstance(err["type"], str):
        return "message and type must be non-empty strings"
    if not all(v is None or isinstance(v, str) for v in (err["param"], err["code"])):
        return "param and code must be strings or null"
    return None


def _stream_problem(text: str) -> str | None:
    """Why an SSE body is malformed (every event JSON, errors in the schema, ``[DONE]`` last), or None."""
    events = [line[len("data: "):] for line in text.split("\n") if line.startswith("data: ")]
    if not events or events[-1] != "[DONE]":
        return "the stream does not end with data: [DONE]"
    for event in events[:-1]:
        try:
            body = json.loads(event, parse_constant=_not_json)
        except ValueError:
            return f"an event is not JSON: {event[:200]}"
        if "error" in body and (why := _error_schema_problem(body)):
            return f"an error event is not OpenAI's schema ({why}): {event[:300]}"
    return None


def _not_json(constant: str):
    """json.loads takes NaN / Infinity, which are not JSON (a client's parser refuses them)."""
    raise ValueError(f"{constant} is not JSON")


def _problem(response: httpx.Response) -> str | None:
    """Why ``response`` breaks the server's contract, or None."""
    status = response.status_code
    if status >= 500:
        busy = status == 503 and "server_busy" in response.text
        if not busy:
            return f"HTTP {status}"
    if response.headers.get("content-type", "").startswith("text/event-stream"):
        return _stream_problem(response.text) if status == 200 else f"HTTP {status} as an event stream"
    try:
        body = response.json()
    except ValueError:
        return f"HTTP {status} with a body that is not JSON"
    if status >= 400:
        why = _error_schema_problem(body)
        return None if why is None else f"HTTP {status} error body: {why}"
    if status == 200 and not (isinstance(body, dict) and isinstance(body.get("choices"), list)):
        return "HTTP 200 without choices"
    return None


def _bounded(body):
    """``body`` with generation capped (MAX_NEW tokens, MAX_N choices); what makes it invalid is kept."""
    if not isinstance(body, dict):
        return body
    body = dict(body)
    for field in ("max_tokens", "max_completion_tokens"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_NEW < value < HUGE:
            body[field] = MAX_NEW
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = MAX_NEW  # null or left out: up to the whole context window
    for field in ("n", "best_of"):
        value = body.get(field)
        if isinstance(value, int) and not isinstance(value, bool) and MAX_N < value <= 64:
            body[field] = MAX_N
    value = body.get("min_tokens")
    if isinstance(value, int) and not isinstance(value, bool) and MAX_NEW < value < HUGE:
        body["min_tokens"] = MAX_NEW
    return body


def _raw(body) -> bytes:
    """JSON text as a careless client writes it: NaN / Infinity allowed, lone surrogates escaped."""
    return json.dumps(body, allow_nan=True).encode()


def _send(client: httpx.Client, path: str, body=None, raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else _raw(_bounded(body))
    return client.post(path, content=content, headers={"Content-Type": "application/json"})


def _check(client: httpx.Client, path: str, body=None, raw: bytes | None = None) -> None:
    response = _send(client, path, body, raw)
    why = _problem(response)
    shown = (raw if raw is not None else _raw(_bounded(body)))[:600]
    assert why is None, f"POST {path} {shown!r}\n-> {why}: {response.text[:600]}"


# ---- schemathesis over the server's OpenAPI schema ------------------------------------------------
def _openapi(client: httpx.Client) -> dict:
    """The server's /openapi.json, with each POST route's body described by the model it parses when the
    schema leaves it out."""
    spec = client.get("/openapi.json").json()
    components = spec.setdefault("components", {}).setdefault("schemas", {})
    for path, model in ROUTES.items():
        operation = spec["paths"][path]["post"]
        if "requestBody" in operation:
            continue
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(schema.pop("$defs", {}))
        operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    return spec


@pytest.fixture(scope="module")
def api_schema(client):
    return schemathesis.openapi.from_dict(_openapi(client))


def test_the_schema_names_both_endpoints(client):
    spec = client.get("/openapi.json").json()
    assert set(ROUTES) <= set(spec["paths"]) and all("post" in spec["paths"][p] for p in ROUTES)


@pytest.mark.parametrize("mode", ["positive", "negative"])
@pytest.mark.parametrize("path", list(ROUTES))
def test_schema_generated_requests_get_no_server_error(api_schema, client, path, mode):
    strategy = api_schema[path]["POST"].as_strategy(generation_mode=schemathesis.GenerationMode(mode))

    @settings(FUZZ, max_examples=40)
    @given(case=strategy)
    def run(case):
        body = case.body if isinstance(case.body, (dict, list, str, int, float, bool)) or case.body is None \
            else None
        _check(client, path, body)
    run()


# ---- mutations of valid bodies ---------------------------------------------------------------------
VALID = {
    "/v1/completions": [
        {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0},
        {"prompt": [1, 50, 345, 28], "max_tokens": 3, "logprobs": 2, "echo": True},
        {"prompt": ["a", "b"], "n": 2, "max_tokens": 2, "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": [[1, 2], [3, 4]], "max_tokens": 2, "seed": 3, "temperature": 0.7, "top_p": 0.9, "top_k": 5,
         "stop": ["\n"], "stop_token_ids": [2], "min_tokens": 1, "ignore_eos": True},
    ],
    "/v1/chat/completions": [
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4},
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [
            {"type": "text", "text": "Hello"}]}], "max_completion_tokens": 3, "logprobs": True, "top_logprobs": 2},
        {"messages": [{"role": "user", "content": "Go"}], "stream": True, "max_tokens": 3, "n": 2,
         "presence_penalty": 0.5, "frequency_penalty": -0.5, "repetition_penalty": 1.1, "min_p": 0.1},
    ],
}
FIELDS = {path: sorted({*model.model_fields, "unknown_field"}) for path, model in ROUTES.items()}
NESTED = [("messages", 0, "content"), ("messages", 0, "role"), ("messages", 0), ("messages", 0, "content", 0, "text"),
          ("messages", 1, "content", 0, "type"), ("prompt", 0), ("prompt", 0, 0), ("prompt", 1, 1),
          ("stream_options", "include_usage"), ("stop", 0), ("stop_token_ids", 0)]


def _nested(depth: int) -> object:
    value: object = 1
    for _ in range(depth):
        value = [value]
    return value


NASTY = [
    None, True, False, 0, -1, -2, 2**31, 2**32 + 1, 2**63 - 1, 2**63, 2**64, -(2**63) - 1, 10**30, -(10**30),
    0.5, -0.0, 1e308, -1e308, 5e-324, math.nan, math.inf, -math.inf, "", "x" * 5000, "\ud800", "a\udfffb",
    "\x00", "1", "true", "null", [], {}, [None], [[]], {"a": 1}, [10**9], [-1], [2**63], [49152], [[10**9]],
    ["\ud800"], [{"type": "text", "text": "\udc00"}], [{"role": "user"}], [{"content": "hi"}],
    [{"role": "user", "content": {"text": "hi"}}], _nested(60),
]
values = st.one_of(st.sampled_from(NASTY), st.integers(), st.floats(allow_nan=True, allow_infinity=True),
                   st.text(st.characters(exclude_categories=()), max_size=20),
                   st.lists(st.integers(), max_size=4), st.lists(st.text(max_size=4), max_size=3))


def _has(node, step) -> bool:
    return isinstance(node, dict) and step in node or \
        isinstance(node, list) and isinstance(step, int) and step < len(node)


def _reaches(body: dict, path: tuple) -> bool:
    """Whether ``body`` holds everything of ``path`` but its last step (so the value there can be set)."""
    node = body
    for step in path[:-1]:
        if not _has(node, step):
            return False
        node = node[step]
    return isinstance(node, dict) or _has(node, path[-1])


def _set(body: dict, path: tuple, value) -> dict:
    """A copy of ``body`` with the value at ``path`` (keys and list indices, reachable) replaced."""
    body = json.loads(json.dumps(body, allow_nan=True))
    node = body
    for step in path[:-1]:
        node = node[step]
    node[path[-1]] = value
    return body


@st.composite
def mutated(draw, path: str) -> dict:
    """A valid body of ``path`` with one to three of its fields (or nested values) replaced or removed."""
    original = body = draw(st.sampled_from(VALID[path]))
    for _ in range(draw(st.integers(1, 3))):
        where = draw(st.sampled_from([(f,) for f in FIELDS[path]] + [p for p in NESTED if _reaches(body, p)]))
        if len(where) == 1 and where[0] in body and draw(st.integers(0, 9)) == 0:
            body = {k: v for k, v in body.items() if k != where[0]}
        else:
            body = _set(body, where, draw(values))
    assume(body != original)
    return body


@pytest.mark.parametrize("path", list(ROUTES))
def test_mutated_valid_bodies_get_no_server_error(client, path):
    @settings(FUZZ, max_examples=50)
    @given(body=mutated(path))
    def run(body):
        _check(client, path, body)
    run()


# ---- fixed cases --------------------------------------------------------------------------------------------
CHAT, COMPLETION = "/v1/chat/completions", "/v1/completions"
FIXED = {  # name -> (path, body or raw bytes)
    "NaN temperature": (COMPLETION, b'{"prompt": "Hi", "max_tokens": 2, "temperature": NaN}'),
    "Infinity top_p": (CHAT, b'{"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "top_p": Infinity}'),
    "-Infinity presence_penalty": (COMPLETION, b'{"prompt": "Hi", "max_tokens": 2, "presence_penalty": -Infinity}'),
    "NaN repetition_penalty": (COMPLETION, b'{"prompt": "Hi", "max_tokens": 2, "repetition_penalty": NaN}'),
    "seed 2**64": (COMPLETION, {"prompt": "Hi", "max_tokens": 2, "seed": 2**64}),
    "seed 2**63 - 1, n 2": (COMPLETION, {"prompt": "Hi", "max_tokens": 2, "seed": 2**63 - 1, "n": 2}),
    "seed -(2**63) - 1": (COMPLETION, {"prompt": "Hi", "max_tokens": 2, "seed": -(2**63) - 1}),
    "seed -1": (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "seed": -1}),
    "max_tokens 2**63": (COMPLETION, {"prompt": "Hi", "max_tokens": 2**63}),
    "top_k 2**63": (COMPLETION, {"prompt": "Hi", "max_tokens": 2, "top_k": 2**63}),
    "top_k 10**9": (COMPLETION, {"prompt": "Hi", "max_tokens": 2, "top_k": 10**9}),
    "min_tokens 2**63": (COMPLETION, {"prompt": "Hi", "max_tokens": 2, "min_tokens": 2**63}),
    "logprobs 2**63": (COMPLETION, {"prompt": "Hi", "max_tokens": 2, "logprobs": 2**63}),
    "token id 10**9": (COMPLETION, {"prompt": [1, 10**9], "max_tokens": 2}),
    "token id -1": (COMPLETION, {"prompt": [-1], "max_tokens": 2}),
    "token id 2**63": (COMPLETION, {"prompt": [[2**63]], "max_tokens": 2}),
    "token id = vocab size": (COMPLETION, {"prompt": [49152], "max_tokens": 2}),
    "stop_token_ids 10**12": (COMPLETION, {"prompt": "Hi", "max_tokens": 2, "stop_token_ids": [10**12]}),
    "stop_token_ids 2**64": (COMPLETION, {"prompt": "Hi", "max_tokens": 2, "stop_token_ids": [2**64]}),
    "lone surrogate prompt": (COMPLETION, {"prompt": "a\ud800b", "max_tokens": 2}),
    "lone surrogate message": (CHAT, {"messages": [{"role": "user", "content": "\udfff"}], "max_tokens": 2}),
    "lone surrogate stop": (COMPLETION, {"prompt": "Hi", "max_tokens": 2, "stop": ["\ud800"]}),
    "lone surrogate model": (COMPLETION, {"prompt": "Hi", "max_tokens": 2, "model": "\ud800"}),
    "raw invalid UTF-8": (COMPLETION, b'{"prompt": "\xff\xfe", "max_tokens": 2}'),
    "NUL in prompt": (COMPLETION, {"prompt": "a\x00b", "max_tokens": 2}),
    "empty token list": (COMPLETION, {"prompt": [], "max_tokens": 2}),
    "empty inner token list": (COMPLETION, {"prompt": [[]], "max_tokens": 2}),
    "empty messages": (CHAT, {"messages": [], "max_tokens": 2}),
    "empty stop string": (COMPLETION, {"prompt": "Hi", "max_tokens": 2, "stop": [""]}),
    "nesting 100 deep": (COMPLETION, {"prompt": _nested(100), "max_tokens": 2}),
    "nesting 100000 deep": (COMPLETION, b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    "body a JSON string": (COMPLETION, b'"hello"'),
    "body empty": (CHAT, b""),
    "body 1 MB of prompt": (COMPLETION, {"prompt": "word " * 200_000, "max_tokens": 2}),
    "huge float temperature": (COMPLETION, {"prompt": "Hi", "max_tokens": 2, "temperature": 1e308}),
    "tiny float top_p": (COMPLETION, {"prompt": "Hi", "max_tokens": 2, "top_p": 5e-324}),
    "integer 10**400": (COMPLETION, b'{"prompt": "Hi", "max_tokens": 2, "seed": 1' + b"0" * 400 + b"}"),
    "float 1e400": (COMPLETION, b'{"prompt": "Hi", "max_tokens": 2, "temperature": 1e400}'),
    "role null": (CHAT, {"messages": [{"role": None, "content": "Hi"}], "max_tokens": 2}),
    "content part without text": (CHAT, {"messages": [{"role": "user", "content": [{"type": "text"}]}],
                                         "max_tokens": 2}),
    "logit_bias with NaN": (COMPLETION, b'{"prompt": "Hi", "max_tokens": 2, "logit_bias": {"1": NaN}}'),
    "echo with logprobs, ids": (COMPLETION, {"prompt": [1, 2, 3], "max_tokens": 2, "echo": True, "logprobs": 20}),
    "1000 prompts": (COMPLETION, {"prompt": [[1, 2]] * 1000, "max_tokens": 2}),
    "10000 stop strings": (COMPLETION, {"prompt": "Hi", "max_tokens": 2, "stop": [f"s{i}" for i in range(10_000)]}),
    "5000 messages": (CHAT, {"messages": [{"role": "user", "content": "Hi"}] * 5000, "max_tokens": 2}),
    "max_tokens 0": (COMPLETION, {"prompt": "Hi", "max_tokens": 0}),
    "n 0": (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 0}),
    "top_logprobs 21": (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "logprobs": True,
                               "top_logprobs": 21}),
    "stream with n 4 and logprobs": (CHAT, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "n": 4,
                                            "stream": True, "logprobs": True, "top_logprobs": 20}),
    # a grammar leaves the tokens it rules out at log-prob -inf, which JSON cannot carry
    "regex with top_logprobs": (CHAT, {"messages": [{"role": "user", "content": "Hello"}], "max_completion_tokens": 3,
                                       "logprobs": True, "top_logprobs": 2, "structured_outputs": {"regex": "1"}}),
    "regex with logprobs, streamed": (COMPLETION, {"prompt": "Hi", "max_tokens": 3, "logprobs": 3, "stream": True,
                                                   "structured_outputs": {"regex": "1"}}),
    "assistant prefill only": (CHAT, {"messages": [{"role": "assistant", "content": "Sure"}], "max_tokens": 2,
                                      "add_generation_prompt": False}),
}
@pytest.mark.parametrize("name", list(FIXED))
def test_hostile_bodies_get_no_server_error(client, name):
    path, body = FIXED[name]
    if isinstance(body, bytes):
        _check(client, path, raw=body)
    else:
        _check(client, path, body)


# ---- afterwards: still serving -----------------------------------------------------------------------------
def test_the_server_still_answers_after_the_fuzzing(server, client):
    assert client.get("/health").status_code == 200
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    first = client.post("/v1/completions", json=body)
    assert first.status_code == 200, first.text
    choice = first.json()["choices"][0]
    assert choice["text"] and choice["finish_reason"] in ("length", "stop")
    again = client.post("/v1/completions", json=body)
    assert again.json()["choices"][0]["text"] == choice["text"]  # greedy: the same text
    assert server.proc.poll() is None
