"""A tiny random Qwen3.5 (hybrid Gated DeltaNet + gated attention) through ``quill serve`` and the openai
client: its answers equal the offline engine's, streamed or not, in a batch of concurrent requests, and a
thinking chat template (Qwen3's ``<think>``) renders, with the thinking in ``reasoning_content``."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest

import quill
from tests.model_util import save_hf_dir
from tests.qwen3_5_util import hf_qwen3_5
from tests.server_util import ServerProcess

# Qwen3's generation prompt when thinking: the answer starts inside <think> (the template's own words,
# trimmed to what the tiny byte tokenizer needs).
THINKING = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)
QUESTIONS = ["the capital of france", "hello world", "what is the answer?", "the quick brown fox"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    d = save_hf_dir(hf_qwen3_5(moe=False, seed=3), tmp_path_factory.mktemp("qwen3_5_serve") / "ckpt")
    config = json.loads((d / "tokenizer_config.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": THINKING}))
    return d


@pytest.fixture(scope="module")
def llm(checkpoint):
    return quill.LLM(str(checkpoint), threads=1)


@pytest.fixture(scope="module")
def server(checkpoint):
    with ServerProcess("--model", str(checkpoint), "--threads", "1", "--max-num-seqs", "4") as s:
        yield s


def offline(llm, question: str, **kw) -> str:
    params = quill.SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)
    return llm.chat([{"role": "user", "content": question}], params, **kw)[0].text


def test_chat_equals_offline_with_thinking_in_reasoning_content(server, llm):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    for q in QUESTIONS[:2]:
        r = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": q}],
                                           max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
        msg = r.choices[0].message
        want = offline(llm, q)  # the model is random: it never closes </think>, so it all is thinking
        assert want and "</think>" not in want
        assert msg.reasoning_content == want and not msg.content
        assert r.usage.prompt_tokens == len(llm.chat_prompt([{"role": "user", "content": q}]))


def test_thinking_off_renders_the_closed_block_and_answers_in_content(server, llm):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    q = QUESTIONS[2]
    r = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": q}],
                                       max_tokens=20, temperature=0,
                                       extra_body={"ignore_eos": True,
                                                   "chat_template_kwargs": {"enable_thinking": False}})
    prompt = llm.chat_prompt([{"role": "user", "content": q}], chat_template_kwargs={"enable_thinking": False})
    assert llm.tokenizer.decode(prompt).endswith("<think>\n\n</think>\n\n")
    assert r.choices[0].message.content == offline(llm, q, chat_template_kwargs={"enable_thinking": False})


def test_concurrent_streams_equal_their_solo_answers(server, llm):
    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)

    async def one(q: str) -> str:
        stream = await client.chat.completions.create(
            model=server.name, messages=[{"role": "user", "content": q}], max_tokens=20, temperature=0,
            stream=True, extra_body={"ignore_eos": True})
        parts = []
        async for chunk in stream:
            if chunk.choices:
                parts.append(getattr(chunk.choices[0].delta, "reasoning_content", None) or "")
                parts.append(chunk.choices[0].delta.content or "")
        return "".join(parts)

    async def all_of_them():
        return await asyncio.gather(*(one(q) for q in QUESTIONS))

    assert asyncio.run(all_of_them()) == [offline(llm, q) for q in QUESTIONS]


def test_template_kwargs_that_would_replace_the_request_are_refused(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "hi"}],
                                       extra_body={"chat_template_kwargs": {"messages": []}})
    assert e.value.body["param"] == "chat_template_kwargs" and "messages" in e.value.body["message"]
    assert client.models.list().data[0].id == server.name  # still serving
