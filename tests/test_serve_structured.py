"""Structured outputs and logit_bias through a live ``quill serve`` (the default model) and the openai client.

One server for the module; answers are read back with ``json.loads`` + ``jsonschema`` and ``re.fullmatch``.
"""

import json
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest

from quill.default_model import default_model_path
from quill.formats.gguf.checkpoint import GGUFCheckpoint
from quill.tokenizer import Tokenizer
from tests.server_util import ServerProcess
from tests.test_structured_outputs import PERSON, TOPICS

pytest.importorskip("xgrammar")

GREEDY = dict(temperature=0, max_tokens=120)


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "16") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=300)


def ask(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Describe {topic} as JSON with name, age, role, address and tags."}]


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "person", "schema": schema, "strict": True}}


def streamed_text(stream) -> tuple[str, str | None]:
    text, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            text.append(c.delta.content or "")
            finish = c.finish_reason or finish
    return "".join(text), finish


def test_json_schema_answers_validate_streamed_and_not(client, server):
    def one(i_topic):
        i, topic = i_topic
        kw = dict(model=server.name, messages=ask(topic), response_format=schema_format(PERSON), **GREEDY)
        if i % 2:
            return streamed_text(client.chat.completions.create(stream=True, **kw))
        r = client.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason

    with ThreadPoolExecutor(len(TOPICS)) as pool:  # one batch in the server
        answers = list(pool.map(one, enumerate(TOPICS)))
    for topic, (text, finish) in zip(TOPICS, answers):
        assert finish == "stop", (topic, text)
        jsonschema.validate(json.loads(text), PERSON)


def test_json_object_regex_choice_and_llama_server_fields(client, server):
    echo = [{"role": "user", "content": 'Answer with exactly this JSON: {"ok": true}'}]
    r = client.chat.completions.create(model=server.name, response_format={"type": "json_object"}, messages=echo,
                                       **GREEDY)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    r = client.completions.create(model=server.name, prompt="My phone number is ", max_tokens=20, temperature=0,
                                  extra_body={"structured_outputs": {"regex": r"[0-9]{3}-[0-9]{4}"}})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text) and r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "Is fire cold?"}],
                                       extra_body={"structured_outputs": {"choice": ["yes", "no"]}}, **GREEDY)
    assert r.choices[0].message.content in ("yes", "no")
    small = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
             "additionalProperties": False}
    r = client.completions.create(model=server.name, prompt="A digit as JSON: ", extra_body={"json_schema": small},
                                  **GREEDY)
    jsonschema.validate(json.loads(r.choices[0].text), small)


def test_max_tokens_mid_json_is_length(client, server):
    r = client.chat.completions.create(model=server.name, messages=ask(TOPICS[0]),
                                       response_format=schema_format(PERSON), temperature=0, max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.choices[0].message.content.startswith("{")


def test_concurrent_mixed_requests_equal_their_solo_answers(client, server):
    """16 at once, constrained and free, each the same greedy tokens as alone."""
    def one(i: int) -> str:
        kw = dict(model=server.name, messages=ask(TOPICS[i % len(TOPICS)]), temperature=0, max_tokens=12)
        if i % 4 == 0:
            kw["response_format"] = schema_format(PERSON)
        elif i % 4 == 1:
            kw["extra_body"] = {"structured_outputs": {"regex": r"[A-Z][a-z]+( [a-z]+)*\."}}
        return client.chat.completions.create(**kw).choices[0].message.content

    solo = [one(i) for i in range(16)]
    with ThreadPoolExecutor(16) as pool:
        together = list(pool.map(one, range(16)))
    assert together == solo


def compiles(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return float(re.search(r"^quill_grammar_compiles_total\{[^}]*\} (\S+)$", text, re.M).group(1))


def test_a_large_schema_is_compiled_once(client, server):
    big = {"type": "object", "properties": {f"key_{i}": {"type": "string", "maxLength": 8} for i in range(60)},
           "required": ["key_0"], "additionalProperties": False}
    before = compiles(server)
    for _ in range(2):
        client.chat.completions.create(model=server.name, messages=ask("a box"), response_format=schema_format(big),
                                       temperature=0, max_tokens=4)
    assert compiles(server) == before + 1


@pytest.mark.parametrize("body,param", [
    ({"response_format": schema_format({"type": "nonsense"})}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"json_schema": PERSON, "structured_outputs": {"choice": ["a"]}}, "json_schema"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"999999": 1}}, "logit_bias"),
])
def test_invalid_specs_are_400_naming_the_field_and_the_server_goes_on(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", timeout=60,
                   json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
    ok = httpx.post(server.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


@pytest.fixture(scope="module")
def tokenizer():
    return Tokenizer(GGUFCheckpoint(default_model_path()).tokenizer_spec())


def test_logit_bias_bans_and_forces_tokens(client, server, tokenizer):
    kw = dict(model=server.name, prompt="The capital of France is", max_tokens=2, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    greedy = tokenizer.encode(free, add_special_tokens=False)[0]
    banned = client.completions.create(**kw, logit_bias={str(greedy): -100}).choices[0].text
    assert tokenizer.encode(banned, add_special_tokens=False)[0] != greedy
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    out = client.chat.completions.create(model=server.name, messages=ask("a cat"), max_tokens=2, temperature=0,
                                         logit_bias={str(forced): 100})
    assert out.choices[0].message.content == tokenizer.decode([forced] * 2)
