"""Gemma 3, gpt-oss and Gemma 4 (tiny random models made with transformers) through ``quill serve`` and the
openai client: chat answers equal the offline engine's, streamed or not, alone or four at once, and a bad
request is a 400 naming its field while the server goes on serving."""

from __future__ import annotations

import asyncio

import openai
import pytest

import quill
from tests.model_util import save_hf_dir
from tests.server_util import ServerProcess
from tests.test_gemma3 import hf_gemma3
from tests.test_gemma4 import hf_gemma4
from tests.test_gpt_oss import hf_gpt_oss

MODELS = {"gemma3_text": hf_gemma3, "gpt_oss": hf_gpt_oss, "gemma4_text": hf_gemma4}
QUESTIONS = ["the capital of france", "hello world", "what is the answer?", "the quick brown fox"]


@pytest.fixture(scope="module", params=list(MODELS))
def served(request, tmp_path_factory):
    d = save_hf_dir(MODELS[request.param](seed=1), tmp_path_factory.mktemp(request.param))  # byte tokenizer, ChatML
    llm = quill.LLM(str(d), threads=1)
    assert llm.model.args.model_type == request.param
    with ServerProcess("--model", str(d), "--threads", "1", "--max-num-seqs", "4") as s:
        yield s, llm


def offline(llm, question: str) -> str:
    params = quill.SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    return llm.chat([{"role": "user", "content": question}], params)[0].text


def ask(client, server, question: str, **kw):
    return client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": question}],
                                          max_tokens=16, temperature=0, extra_body={"ignore_eos": True}, **kw)


def test_chat_whole_and_streamed_equals_offline(served):
    server, llm = served
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    for q in QUESTIONS[:2]:
        want = offline(llm, q)
        assert want and ask(client, server, q).choices[0].message.content == want
        streamed = "".join(c.choices[0].delta.content or "" for c in ask(client, server, q, stream=True) if c.choices)
        assert streamed == want


def test_four_streams_at_once_and_a_bad_request(served):
    server, llm = served
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)

    async def one(q: str) -> str:
        parts = []
        async for chunk in await ask(client, server, q, stream=True):
            if chunk.choices:
                parts.append(chunk.choices[0].delta.content or "")
        return "".join(parts)

    async def all_of_them():
        return await asyncio.gather(*(one(q) for q in QUESTIONS))

    assert asyncio.run(all_of_them()) == [offline(llm, q) for q in QUESTIONS]
    sync = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        sync.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "hi"}], max_tokens=-1)
    assert e.value.body["param"] == "max_tokens"
    assert ask(sync, server, QUESTIONS[0]).choices[0].message.content == offline(llm, QUESTIONS[0])  # still serving
