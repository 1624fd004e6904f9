"""``quill serve`` as a user runs it: a live server on 127.0.0.1, the official ``openai`` client, raw HTTP.

The default model serves; the oracle for every greedy answer is ``LLM.generate`` / ``LLM.chat``
on the same model in this process.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import openai
import pytest

import quill
from quill.errors import GenerationError
from quill.serving.engine import EngineStopped
from tests.server_util import ServerProcess

GREEDY = dict(temperature=0.0)
QUESTIONS = ["What is the capital of France?", "Name three colours.", "Write one sentence about the sea.",
             "What is 2 + 2?", "Say hello in Spanish.", "Why is the sky blue?"]


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "16") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm():
    return quill.LLM()


def chat_offline(llm, question: str, max_tokens: int, **kw):
    params = quill.SamplingParams(max_tokens=max_tokens, **GREEDY, **kw)
    return llm.chat([{"role": "user", "content": question}], params)[0]


# ---- the openai client ---------------------------------------------------------------------------

def test_models_lists_the_served_model(client, server):
    models = client.models.list().data
    assert [m.id for m in models] == [server.name]


def test_chat_greedy_equals_offline(client, server, llm):
    for q in QUESTIONS[:3]:
        r = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": q}],
                                           max_tokens=24, temperature=0)
        want = chat_offline(llm, q, 24)
        assert r.choices[0].message.content == want.text
        assert r.choices[0].message.role == "assistant"
        assert r.choices[0].finish_reason == want.finish_reason
        assert r.usage.completion_tokens == len(want.token_ids)
        assert r.usage.prompt_tokens == len(llm.chat_prompt([{"role": "user", "content": q}]))
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_equals_offline_and_reports_usage(client, server, llm):
    q = QUESTIONS[2]
    stream = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": q}],
                                            max_tokens=30, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    pieces, finish, usage, roles = [], None, None, []
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    want = chat_offline(llm, q, 30)
    assert "".join(pieces) == want.text and finish == want.finish_reason and roles == ["assistant"]
    assert usage.completion_tokens == len(want.token_ids)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_completions_greedy_streamed_and_not_equal_offline(client, server, llm):
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    want = llm.generate(prompts, quill.SamplingParams(max_tokens=12, **GREEDY))
    r = client.completions.create(model=server.name, prompt=prompts, max_tokens=12, temperature=0)
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [w.text for w in want]
    assert r.usage.prompt_tokens == sum(len(w.prompt_token_ids) for w in want)
    assert r.usage.completion_tokens == sum(len(w.token_ids) for w in want)
    text = "".join(c.choices[0].text for c in client.completions.create(
        model=server.name, prompt=prompts[0], max_tokens=12, temperature=0, stream=True) if c.choices)
    assert text == want[0].text


def test_n_and_seed(client, server):
    kw = dict(model=server.name, prompt="Once upon a time", max_tokens=16, temperature=1.0, n=2)
    a = client.completions.create(seed=7, **kw)
    b = client.completions.create(seed=7, **kw)
    texts = lambda r: [c.text for c in sorted(r.choices, key=lambda c: c.index)]  # noqa: E731
    assert len(a.choices) == 2 and texts(a) == texts(b)
    assert texts(a)[0] != texts(a)[1]  # seed + index: the two choices differ
    c = client.completions.create(seed=8, **kw)
    assert texts(c) != texts(a)
    chat = client.chat.completions.create(model=server.name, n=2, seed=3, max_tokens=8, temperature=1.0,
                                          messages=[{"role": "user", "content": "Tell me a word."}])
    assert sorted(c.index for c in chat.choices) == [0, 1]


def test_stop_strings_and_finish_reason(client, server, llm):
    base = llm.generate("1, 2, 3, 4,", quill.SamplingParams(max_tokens=12, **GREEDY))[0].text
    stop = base.strip()[:2]  # a string the greedy answer contains
    r = client.completions.create(model=server.name, prompt="1, 2, 3, 4,", max_tokens=12, temperature=0,
                                  stop=[stop])
    assert stop not in r.choices[0].text and r.choices[0].finish_reason == "stop"
    assert base.startswith(r.choices[0].text)
    r = client.completions.create(model=server.name, prompt="1, 2, 3, 4,", max_tokens=3, temperature=0)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3


def test_logprobs_match_offline(client, server, llm):
    want = llm.generate("The capital of France is", quill.SamplingParams(max_tokens=4, logprobs=3, **GREEDY))[0]
    r = client.completions.create(model=server.name, prompt="The capital of France is", max_tokens=4,
                                  temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == 4 and len(lp.top_logprobs[0]) == 3
    for tok, got, top, step in zip(want.token_ids, lp.token_logprobs, lp.top_logprobs, want.logprobs):
        assert got == pytest.approx(step[tok].logprob, abs=1e-5)
        assert max(top.values()) == pytest.approx(max(x.logprob for x in step.values()), abs=1e-5)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    c = client.chat.completions.create(model=server.name, max_tokens=5, temperature=0, logprobs=True,
                                       top_logprobs=2, messages=[{"role": "user", "content": "Hi"}])
    content = c.choices[0].logprobs.content
    assert len(content) == c.usage.completion_tokens
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)
    assert "".join(t.token for t in content).startswith(c.choices[0].message.content[:3])


def test_echo(client, server):
    r = client.completions.create(model=server.name, prompt="The capital of France is", max_tokens=3,
                                  temperature=0, echo=True, logprobs=1)
    plain = client.completions.create(model=server.name, prompt="The capital of France is", max_tokens=3,
                                      temperature=0)
    assert r.choices[0].text == "The capital of France is" + plain.choices[0].text
    lp = r.choices[0].logprobs
    assert lp.token_logprobs[0] is None and all(v is not None for v in lp.token_logprobs[1:])
    assert len(lp.tokens) == r.usage.prompt_tokens + 3
    # every token's text, the first prompt token's too (it has no log-prob), and offsets into the text
    assert "".join(lp.tokens) == r.choices[0].text and lp.tokens[0] == "The"
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(len(lp.tokens))]
    streamed = client.completions.create(model=server.name, prompt="The capital of France is", max_tokens=3,
                                         temperature=0, echo=True, logprobs=1, stream=True)
    tokens = [t for chunk in streamed for t in chunk.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


# ---- scheduling through the server ------------------------------------------------------------

async def _stream_completion(http: httpx.AsyncClient, body: dict, times: list | None = None,
                             cut_after: int | None = None) -> tuple[str, str | None]:
    """Stream one completion; return (text, finish). ``cut_after``: disconnect after that many chunks."""
    text, finish, n = [], None, 0
    async with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            text.append(choice["text"])
            finish = choice["finish_reason"] or finish
            if times is not None:
                times.append(time.monotonic())
            n += 1
            if cut_after is not None and n >= cut_after:
                return "".join(text), None  # leaving the block closes the connection mid-stream
    return "".join(text), finish


def test_continuous_batching_late_request_starts_before_others_end(server, llm):
    long_body = dict(prompt="Write a long story about a dragon.", max_tokens=120, temperature=0, ignore_eos=True)
    late_body = dict(prompt="The capital of France is", max_tokens=8, temperature=0)

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as http:
            long_times: list[float] = []
            longs = [asyncio.create_task(_stream_completion(http, long_body, long_times)) for _ in range(3)]
            while len(long_times) < 12:  # the long ones are decoding
                await asyncio.sleep(0.01)
            late_times: list[float] = []
            late = await _stream_completion(http, late_body, late_times)
            return late, late_times, await asyncio.gather(*longs), long_times

    late, late_times, longs, long_times = asyncio.run(main())
    assert late[0] == llm.generate(late_body["prompt"], quill.SamplingParams(max_tokens=8, **GREEDY))[0].text
    assert late_times[0] < max(long_times)  # it joined the running batch instead of waiting for it
    want = llm.generate(long_body["prompt"], quill.SamplingParams(max_tokens=120, ignore_eos=True, **GREEDY))[0]
    assert all(text == want.text and finish == "length" for text, finish in longs)


def test_prefix_cache_second_chat_turn(client, server, llm):
    system = {"role": "system", "content": "You are a helpful assistant who answers in one careful sentence. " * 3}
    turn1 = [system, {"role": "user", "content": "What is the capital of France?"}]
    first = client.chat.completions.create(model=server.name, messages=turn1, max_tokens=40, temperature=0)
    answer = first.choices[0].message.content
    turn2 = turn1 + [{"role": "assistant", "content": answer}, {"role": "user", "content": "And of Spain?"}]
    second = client.chat.completions.create(model=server.name, messages=turn2, max_tokens=20, temperature=0)
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens
    cold = quill.LLM().chat(turn2, quill.SamplingParams(max_tokens=20, **GREEDY))[0]  # a fresh engine: no cache
    assert second.choices[0].message.content == cold.text


def streams_with_disconnects(server, llm) -> None:
    """64 concurrent streams of mixed lengths, 10 cut mid-stream: the rest finish with their offline text."""
    bodies = [dict(prompt=f"{QUESTIONS[i % len(QUESTIONS)]} ({i})", max_tokens=6 + (i * 7) % 40, temperature=0)
              for i in range(64)]
    cut = set(range(3, 63, 6))  # 10 clients leave after 2 chunks
    assert len(cut) == 10
    offline = llm.generate([b["prompt"] for b in bodies],
                           [quill.SamplingParams(max_tokens=b["max_tokens"], **GREEDY) for b in bodies])

    async def main():
        async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                     limits=httpx.Limits(max_connections=100)) as http:
            return await asyncio.gather(*[_stream_completion(http, b, cut_after=2 if i in cut else None)
                                          for i, b in enumerate(bodies)])

    for i, (text, finish) in enumerate(asyncio.run(main())):
        if i not in cut:
            assert text == offline[i].text and finish == offline[i].finish_reason, i


def test_many_streaming_clients_some_disconnecting(server, llm):
    """64 concurrent streams, 10 cut mid-stream: the rest finish with their offline text, and afterwards
    nothing is left running or holding KV blocks."""
    streams_with_disconnects(server, llm)
    deadline = time.monotonic() + 30
    while True:
        m = server.metrics()
        if m["quill_num_requests_running"] == 0 and m["quill_kv_cache_blocks_used"] == 0 or \
                time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert m["quill_num_requests_running"] == 0 and m["quill_num_requests_waiting"] == 0
    assert m["quill_kv_cache_blocks_used"] == 0
    assert m["quill_requests_finished_total"] >= 54
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_non_streaming_client_that_leaves_is_aborted(server):
    body = dict(prompt="Count slowly:", max_tokens=2000, temperature=0, ignore_eos=True)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=1.5)
    deadline = time.monotonic() + 20
    while server.metrics()["quill_num_requests_running"] and time.monotonic() < deadline:
        time.sleep(0.1)
    m = server.metrics()
    assert m["quill_num_requests_running"] == 0 and m["quill_kv_cache_blocks_used"] == 0


# ---- bad requests -----------------------------------------------------------------------------

BAD = [
    ("/v1/completions", b"{not json", None),
    ("/v1/completions", b"[1, 2]", None),
    ("/v1/completions", {"prompt": 5}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": "ten"}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -0.5}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("/v1/completions", {"prompt": "x", "top_p": 1.01}, "top_p"),
    ("/v1/completions", {"prompt": "x", "n": "2"}, "n"),
    ("/v1/completions", {"prompt": "x", "stop": 3}, "stop"),
    ("/v1/completions", {"prompt": "x", "min_tokens": 9, "max_tokens": 4}, "min_tokens"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/completions", {"prompt": [10 ** 9]}, "prompt"),
    ("/v1/completions", {"prompt": "word " * 9000}, "prompt"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 9000}, "max_tokens"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
]


@pytest.mark.parametrize("path,body,param", BAD, ids=[f"{i}-{b[2]}" for i, b in enumerate(BAD)])
def test_bad_requests_are_4xx_naming_the_field(server, path, body, param):
    kw = {"content": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else \
        {"json": body}
    r = httpx.post(server.url + path, timeout=30, **kw)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if param:
        assert param.split("[")[0] in err["message"]
    assert httpx.get(server.url + "/health").status_code == 200


def test_unknown_model_and_route(server):
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "x", "model": "gpt-9"})
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert r.json()["error"]["code"] == "model_not_found"
    r = httpx.get(server.url + "/v1/nothing-here")
    assert r.status_code == 404 and "error" in r.json()


def test_openai_client_raises_on_bad_request(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=server.name, prompt="x", temperature=-1)
    assert e.value.body["param"] == "temperature"


# ---- a small server: API key, full queue, SIGTERM ------------------------------------------------

@pytest.mark.parametrize("driver", [[], ["--engine-thread"]], ids=["loop", "engine-thread"])
def test_api_key_full_queue_and_graceful_sigterm(driver):
    with ServerProcess("--api-key", "sk-test", "--max-num-seqs", "1", "--max-waiting", "1",
                       "--shutdown-timeout", "60", *driver) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2},
                       headers={"Authorization": "Bearer wrong"})
        assert r.status_code == 401
        assert httpx.get(s.url + "/health").status_code == 200  # health and metrics need no key
        auth = {"Authorization": "Bearer sk-test"}
        long = dict(prompt="Tell me a story.", max_tokens=60, temperature=0, ignore_eos=True)
        results: dict[int, httpx.Response] = {}

        def post(i):
            results[i] = httpx.post(s.url + "/v1/completions", json=long, headers=auth, timeout=300)

        threads = [threading.Thread(target=post, args=(i,)) for i in range(2)]  # one runs, one waits
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while s.metrics().get("quill_num_requests_waiting", 0) < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        busy = httpx.post(s.url + "/v1/completions", json=long, headers=auth, timeout=30)
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1"
        assert busy.json()["error"]["type"] == "server_error"
        s.proc.send_signal(signal.SIGTERM)  # running and waiting requests still finish
        for t in threads:
            t.join(300)
        assert s.proc.wait(120) == 0
        assert [results[i].status_code for i in range(2)] == [200, 200]
        assert all(results[i].json()["usage"]["completion_tokens"] == 60 for i in range(2))


# ---- the load generator of `quill bench serve` ---------------------------------------------------

def test_load_generator_against_the_server(server):
    from quill.bench.load import Workload, run_load
    work = Workload.random(5, seed=3, prompt_words=(8, 16), output_tokens=(3, 9))
    assert work == Workload.random(5, seed=3, prompt_words=(8, 16), output_tokens=(3, 9))  # seeded
    result = asyncio.run(run_load(server.url, server.name, work, clients=2))
    assert [r.error for r in result.records] == [None] * 5
    assert sorted(r.tokens for r in result.records) == sorted(n for _, n in work.requests)
    assert all(len(r.chunks) == r.tokens for r in result.records)  # one timed chunk per token
    s = result.summary()
    assert s["requests"] == 5 and s["output_tokens"] == sum(n for _, n in work.requests)
    assert 0 < s["ttft_p50_ms"] <= s["ttft_p99_ms"] and 0 < s["itl_p50_ms"] <= s["itl_p99_ms"]



def test_light_reader_times_every_token(server):
    from quill.bench.light import stream_once
    rec = stream_once(server.url, server.name, "The capital of France is", 7)
    assert rec.error is None and rec.tokens == 7 and len(rec.chunks) == 7
    assert rec.sent <= rec.chunks[0] and rec.chunks == sorted(rec.chunks)
    bad = stream_once(server.url, "no-such-model", "Hi", 3)
    assert bad.error is not None and "404" in bad.error and not bad.chunks

# ---- errors that arrive after the request was accepted --------------------------------------------

class _FailingEngine:
    """An engine that accepts a submission and then fails it with ``error`` (the way a replica whose KV
    pool is smaller than the ingress thought, or an engine thread that died, does)."""

    def __init__(self, error):
        self.error = error

    def check(self, ids, label, params=None):
        return list(ids)

    def submit(self, requests, affinity=None, streamed=True):
        error = self.error

        class Handle:
            sub = type("Sub", (), {"requests": requests})

            def __aiter__(self):
                return self

            async def __anext__(self):
                raise error

            def close(self):
                pass

        return Handle()


@pytest.mark.parametrize("error,status", [
    (GenerationError("prompt has 9000 tokens, more than the KV cache holds (4096 tokens)"), 400),
    (EngineStopped("the engine failed"), 503),
])
def test_errors_after_acceptance_are_openai_errors(error, status):
    from quill.serving.openai import OpenAIServing
    from quill.serving.protocol import APIError, CompletionRequest
    serving = OpenAIServing(_FailingEngine(error), None, "m", 8192)
    with pytest.raises(APIError) as e:
        asyncio.run(serving.completions(CompletionRequest(prompt=[1, 2, 3], max_tokens=4)))
    assert e.value.status == status and str(error) in e.value.message

    async def streamed():
        stream = await serving.completions(CompletionRequest(prompt=[1, 2, 3], max_tokens=4, stream=True))
        return [event async for event in stream]

    events = asyncio.run(streamed())
    assert events[-1] == "data: [DONE]\n\n"
    body = json.loads(events[-2][len("data: "):])
    assert str(error) in body["error"]["message"]


# ---- --stream-interval ------------------------------------------------------------------------------

def test_stream_interval_through_the_server(llm):
    """``--stream-interval 3``: the same tokens, text and log-probabilities, one event per token.  The server
    runs the AVX2 kernel variants (``--isa avx2``), which compute the bits of the native ones."""
    prompt = "The capital of France is"
    want = llm.generate([prompt], quill.SamplingParams(max_tokens=11, logprobs=1, **GREEDY))[0]
    with ServerProcess("--stream-interval", "3", "--isa", "avx2") as s:
        client = openai.OpenAI(base_url=s.base_url, api_key="unused", max_retries=0, timeout=120)
        chunks = [c for c in client.completions.create(model=s.name, prompt=prompt, max_tokens=11, temperature=0,
                                                       logprobs=1, stream=True) if c.choices]
        assert "".join(c.choices[0].text for c in chunks) == want.text
        tokens = [t for c in chunks for t in c.choices[0].logprobs.tokens]
        assert len(tokens) == len(want.token_ids) == len(chunks)
        lps = [lp for c in chunks for lp in c.choices[0].logprobs.token_logprobs]
        assert lps == pytest.approx([d[t].logprob for d, t in zip(want.logprobs, want.token_ids)], abs=1e-5)
        from quill.bench.light import stream_once
        rec = stream_once(s.url, s.name, prompt, 11)
        assert rec.error is None and rec.tokens == 11 and len(rec.chunks) == 11


def test_serve_refuses_a_stream_interval_below_one():
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-m", "quill", "serve", "--stream-interval", "0", "--port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--stream-interval: expected an integer >= 1, found 0" in r.stderr
