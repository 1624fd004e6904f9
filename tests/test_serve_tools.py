"""Tool calling through a live ``quill serve`` on the default model with the official ``openai`` client
(issue 42): tools and tool results rendered into the prompt, ``tool_choice`` (none, auto, required, a
named function), calls parsed into ``tool_calls`` whole and streamed, bad tool fields refused by name.

SmolLM2's template knows no tools, so quill writes them in Hermes' format (quill.chat_tools) and reads
``<tool_call>`` blocks back.  With ``tool_choice`` required or named, quill writes the call's opening into
the prompt and holds the rest to the tool's JSON schema (the engine's structured outputs), so even a
135M model's call parses; a conversation that already holds one call gets it to write the next well.
Prompt sizes are checked against the prompt rendered here with the model's own tokenizer: the tools and
tool results really are in it.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from quill.default_model import default_model_path
from quill.formats.gguf.checkpoint import GGUFCheckpoint
from quill.tokenizer import Tokenizer
from tests.server_util import ServerProcess

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                   "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current time in a timezone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]}}}
FIRST_TURN = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"},
]
NEXT_CITY = [*FIRST_TURN, {"role": "user", "content": "And what is the weather in London?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "4") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=600, max_retries=0)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(GGUFCheckpoint(default_model_path()).tokenizer_spec())


def _prompt_tokens(tokenizer: Tokenizer, messages, tools=None, opening: str = "") -> int:
    return len(tokenizer.encode(tokenizer.apply_chat_template(messages, True, tools) + opening,
                                add_special_tokens=False))


@pytest.fixture(scope="module")
def named_call(client, server):
    return client.chat.completions.create(model=server.name, messages=NEXT_CITY, tools=[WEATHER, TIME],
                                          tool_choice=NAMED, temperature=0, max_tokens=30)


def test_a_two_turn_conversation_with_a_tool_result_answers(client, server, tokenizer):
    r = client.chat.completions.create(model=server.name, messages=FIRST_TURN, tools=[WEATHER],
                                       temperature=0, max_tokens=16)
    choice = r.choices[0]
    assert choice.finish_reason in ("stop", "length") and choice.message.content
    assert r.usage.prompt_tokens == _prompt_tokens(tokenizer, FIRST_TURN, [WEATHER])
    rendered = tokenizer.apply_chat_template(FIRST_TURN, True, [WEATHER])
    assert "<tool_response>\n22 C, sunny\n</tool_response>" in rendered and '"name": "get_weather"' in rendered


def test_tool_choice_none_does_not_offer_the_tools(client, server, tokenizer):
    r = client.chat.completions.create(model=server.name, messages=NEXT_CITY, tools=[WEATHER], tool_choice="none",
                                       temperature=0, max_tokens=4)
    assert r.usage.prompt_tokens == _prompt_tokens(tokenizer, NEXT_CITY)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


def test_a_named_tool_choice_gives_a_parseable_schema_valid_call(named_call, tokenizer):
    choice = named_call.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    opening = '<tool_call>\n{"name": "get_weather", "arguments": '
    assert named_call.usage.prompt_tokens == _prompt_tokens(tokenizer, NEXT_CITY, [WEATHER, TIME], opening)


def test_streamed_tool_call_deltas_reassemble_to_the_whole_answer(client, server, named_call):
    stream = client.chat.completions.create(model=server.name, messages=NEXT_CITY, tools=[WEATHER, TIME],
                                            tool_choice=NAMED, temperature=0, max_tokens=30, stream=True)
    calls, finish, content = {}, None, ""
    for chunk in stream:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for d in delta.tool_calls or ():
            if d.index not in calls:  # OpenAI's order: id, type and name first, then argument fragments
                assert d.id.startswith("call_") and d.type == "function" and d.function.name
                calls[d.index] = {"name": d.function.name, "arguments": d.function.arguments or ""}
            else:
                assert d.id is None and not d.function.name
                calls[d.index]["arguments"] += d.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    whole = named_call.choices[0].message.tool_calls
    assert finish == "tool_calls" and content == ""
    assert list(calls.values()) == [{"name": c.function.name, "arguments": c.function.arguments} for c in whole]


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_a_forced_call_on_a_bare_question_is_schema_valid(client, server, choice):
    """No example call in the history: the arguments (and with required the name) are held to the schema."""
    r = client.chat.completions.create(model=server.name, messages=[{"role": "user", "content": "Time in Tokyo?"}],
                                       tools=[WEATHER, TIME], tool_choice=choice, temperature=0, max_tokens=60)
    assert r.choices[0].finish_reason == "tool_calls"
    (call,) = r.choices[0].message.tool_calls
    tool = {"get_weather": WEATHER, "get_time": TIME}[call.function.name]
    assert choice == "required" or tool is WEATHER
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("fields, param, words", [
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_wether"}}},
     "tool_choice", "'get_wether', which is not among the tools (get_weather)"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "of type 'object', found type 'string'"),
    ({"tools": [{"type": "function", "function": {"name": "get weather"}}]},
     "tools[0].function.name", "is not a function name"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "names two tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name",
     "required"),
])
def test_bad_tool_fields_are_400s_naming_the_field(client, server, fields, param, words):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=server.name, messages=NEXT_CITY, max_tokens=4, **fields)
    assert e.value.body["param"] == param and words in e.value.body["message"]
