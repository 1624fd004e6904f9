"""One request must never stop ``quill serve``'s engine: requests that once did, clients that leave, calls
that can never fit -- against a live server on either engine driver (the event loop's task, or a thread).

After each trigger the server must still be healthy and answer a plain greedy request with the text
``LLM.generate`` gives offline on the same model.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

import quill
from tests.server_util import ServerProcess

GREEDY = dict(temperature=0.0)
MAX_NUM_SEQS, MAX_WAITING = 4, 8
PROBE = "The capital of France is"


@pytest.fixture(scope="module", params=["loop", "engine-thread"])
def server(request):
    driver = ["--engine-thread"] if request.param == "engine-thread" else []
    with ServerProcess("--max-num-seqs", str(MAX_NUM_SEQS), "--max-waiting", str(MAX_WAITING), *driver) as s:
        yield s


@pytest.fixture(scope="module")
def llm():
    return quill.LLM()


@pytest.fixture(scope="module")
def probe_text(llm):
    return llm.generate(PROBE, quill.SamplingParams(max_tokens=8, **GREEDY))[0].text


def assert_serving(server, probe_text: str) -> None:
    """/health is 200 and a plain request gets its offline greedy text."""
    health = httpx.get(server.url + "/health", timeout=30)
    assert health.status_code == 200 and health.json() == {"status": "ok"}, health.text
    r = httpx.post(server.url + "/v1/completions", json={"prompt": PROBE, "max_tokens": 8, **GREEDY}, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == probe_text, r.text


# Each of these stopped the engine for good (every later request and /health answered 503).
TRIGGERS = [
    ({"seed": 2**64}, "seed"),  # torch's generator refused it as the request was added
    ({"seed": -2**63 - 1}, "seed"),
    ({"seed": 2**64 - 1, "n": 2}, "seed"),  # choice 1 samples with seed + 1
    ({"stop_token_ids": [100000], "min_tokens": 1}, "stop_token_ids"),  # masked a logit past the vocabulary
    ({"repetition_penalty": 1e-300, "temperature": 1.0}, "repetition_penalty"),  # inf logits, NaN probabilities
    ({"temperature": "1e999"}, "temperature"),  # infinite once json.loads reads it
]


@pytest.mark.parametrize("fields,param", TRIGGERS, ids=[f"{i}-{t[1]}" for i, t in enumerate(TRIGGERS)])
def test_a_request_that_stopped_the_engine_is_a_400_naming_the_field(server, probe_text, fields, param):
    body = json.dumps({"prompt": PROBE, "max_tokens": 4, **fields}).replace('"1e999"', "1e999")
    r = httpx.post(server.url + "/v1/completions", content=body, timeout=60,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"] and err["type"] == "invalid_request_error", err
    assert_serving(server, probe_text)


def test_a_temperature_below_the_greedy_threshold_is_greedy(server, probe_text):
    r = httpx.post(server.url + "/v1/completions", timeout=120,
                   json={"prompt": PROBE, "max_tokens": 8, "temperature": 1e-40})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == probe_text, r.text
    assert_serving(server, probe_text)


def test_a_call_that_can_never_fit_is_a_400_with_the_capacity(server, probe_text):
    capacity = MAX_NUM_SEQS + MAX_WAITING
    r = httpx.post(server.url + "/v1/completions", timeout=60,
                   json={"prompt": ["a", "b"], "n": capacity // 2 + 1, "max_tokens": 2})
    assert r.status_code == 400 and "retry-after" not in r.headers, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and f"at once: {capacity} " in err["message"], err
    assert_serving(server, probe_text)


async def _cut_stream(http: httpx.AsyncClient, body: dict, after: int) -> int:
    """Stream ``body`` and disconnect after ``after`` events; the number of events read."""
    n = 0
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                n += 1
                if n >= after:
                    break  # leaving the block closes the connection mid-stream
    return n


def _wait_idle(server, timeout: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        if (m["quill_num_requests_running"] == 0 and m["quill_num_requests_waiting"] == 0) or \
                time.monotonic() > deadline:
            return m


def test_clients_that_leave_are_aborted_within_a_step(server, probe_text):
    """Two 1000-token streams cut after a few tokens, and a non-streamed 1000-token call whose client
    times out: all are aborted (not decoded on to max_tokens), their blocks freed, /metrics counts them."""
    body = {"prompt": "Count slowly:", "max_tokens": 1000, "ignore_eos": True, **GREEDY}
    before = server.metrics()

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as http:
            return await asyncio.gather(_cut_stream(http, body, 3), _cut_stream(http, body, 5))

    assert asyncio.run(main()) == [3, 5]
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.5)
    m = _wait_idle(server)
    assert m["quill_num_requests_running"] == 0 and m["quill_kv_cache_blocks_used"] == 0
    generated = m["quill_generation_tokens_total"] - before["quill_generation_tokens_total"]
    assert generated < 500, generated  # three requests decoded to the end would make 3000
    time.sleep(1.0)
    assert server.metrics()["quill_generation_tokens_total"] == m["quill_generation_tokens_total"]
    assert m["quill_requests_aborted_total"] - before.get("quill_requests_aborted_total", 0) == 3
    aborted = _labelled(server, "quill_requests_finished_total", 'finish_reason="abort"')
    assert aborted >= 3
    assert_serving(server, probe_text)


def _labelled(server, name: str, label: str) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") and label in line)


def test_health_says_why_the_engine_stopped(llm, monkeypatch):
    """A fault no request owns (here the whole step raising) stops the engine: requests get 503 and
    /health says why.  In process: the app of ``quill serve`` over ASGI."""
    from starlette.testclient import TestClient

    from quill.serving.app import create_app

    app = create_app(llm)

    def broken():
        raise RuntimeError("a fault no request owns")

    with TestClient(app, base_url="http://127.0.0.1") as client:
        assert client.get("/health").json() == {"status": "ok"}
        monkeypatch.setattr(app.state.engine, "_step", broken)
        r = client.post("/v1/completions", json={"prompt": PROBE, "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["type"] == "server_error", r.text
        health = client.get("/health")
        assert health.status_code == 503
        assert health.json() == {"status": "unavailable",
                                 "reason": "the engine failed: RuntimeError: a fault no request owns"}
