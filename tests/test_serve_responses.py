"""The Responses API (``POST /v1/responses``) through a live ``quill serve`` on the default model, with
the official ``openai`` client's ``responses.create`` and the OpenAI Agents SDK (issue 42): text, a function
call, a JSON schema (``text.format``, held to it by the engine's structured outputs), refusals.

Streamed and whole answers are compared (greedy, so they must be equal): the typed events in their
order, text deltas, function-call argument deltas, and ``response.completed`` against the unstreamed
response.  The tool cases continue a conversation that already holds one call (``function_call`` and
``function_call_output`` items), which gets the 135M model to write the next call well-formed.
"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest

from quill.default_model import default_model_path
from quill.formats.gguf.checkpoint import GGUFCheckpoint
from quill.tokenizer import Tokenizer
from tests.server_util import ServerProcess

PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Get the current weather in a city",
           "parameters": PARAMS}
HISTORY = [
    {"role": "user", "content": "What is the weather in Paris?"},
    {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
    {"type": "function_call_output", "call_id": "call_1", "output": "22 C, sunny"},
    {"role": "user", "content": [{"type": "input_text", "text": "And what is the weather in London?"}]},
]
NAMED = {"type": "function", "name": "get_weather"}


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-num-seqs", "4") as s:
        yield s


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", timeout=600, max_retries=0)


def _events(stream) -> list:
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    return events


def test_text_whole_and_streamed(client, server):
    kw = dict(model=server.name, instructions="Answer in one short sentence.", input="What is the capital of France?",
              temperature=0, max_output_tokens=12)
    whole = client.responses.create(**kw)
    assert whole.object == "response" and whole.output[0].type == "message" and whole.output_text
    tok = Tokenizer(GGUFCheckpoint(default_model_path()).tokenizer_spec())
    prompt = tok.apply_chat_template([{"role": "system", "content": kw["instructions"]},
                                      {"role": "user", "content": kw["input"]}])
    assert whole.usage.input_tokens == len(tok.encode(prompt, add_special_tokens=False))
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens
    assert (whole.status == "incomplete") == (whole.usage.output_tokens == 12)
    events = _events(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", *["response.output_text.delta"] * len(deltas),
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    done = events[-1].response
    assert "".join(deltas) == events[-4].text == done.output_text == whole.output_text
    assert done.status == whole.status and done.usage.output_tokens == whole.usage.output_tokens


def test_a_function_call_whole_and_streamed(client, server):
    kw = dict(model=server.name, input=HISTORY, tools=[WEATHER], tool_choice=NAMED, temperature=0,
              max_output_tokens=30)
    whole = client.responses.create(**kw)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    jsonschema.validate(json.loads(call.arguments), PARAMS)
    events = _events(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    n = kinds.count("response.function_call_arguments.delta")
    assert n >= 1 and kinds == ["response.created", "response.in_progress", "response.output_item.added",
                                *["response.function_call_arguments.delta"] * n,
                                "response.function_call_arguments.done", "response.output_item.done",
                                "response.completed"]
    added, done = events[2].item, events[-1].response
    assert added.name == "get_weather" and added.arguments == ""
    assert "".join(e.delta for e in events if e.type.endswith("arguments.delta")) == call.arguments
    assert [(o.type, o.name, o.arguments) for o in done.output] == [("function_call", "get_weather", call.arguments)]


PLACE = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                          "country": {"type": "string", "maxLength": 24}},
         "required": ["city", "country"], "additionalProperties": False}


def test_a_json_schema_answer_whole_and_streamed(client, server):
    kw = dict(model=server.name, input="Name a big city and its country.", temperature=0, max_output_tokens=60,
              text={"format": {"type": "json_schema", "name": "place", "schema": PLACE, "strict": True}})
    whole = client.responses.create(**kw)
    assert whole.status == "completed"
    jsonschema.validate(json.loads(whole.output_text), PLACE)
    events = _events(client.responses.create(**kw, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == whole.output_text


@pytest.mark.parametrize("fields, param", [
    ({"previous_response_id": "resp_123"}, "previous_response_id"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{**WEATHER, "parameters": {"type": "array"}}]}, "tools[0].parameters"),
    ({"tool_choice": {"type": "function", "name": "get_time"}, "tools": [WEATHER]}, "tool_choice"),
    ({"input": [{"type": "image_generation_call", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
])
def test_what_quill_cannot_do_is_a_400_naming_the_field(client, server, fields, param):
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(**{"model": server.name, "input": "Hi", "max_output_tokens": 4, **fields})
    assert e.value.body["param"] == param


def test_the_openai_agents_sdk_runs_a_tool_using_turn(server):
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # the SDK would send traces to api.openai.com
    seen = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        seen.append(city)
        return f"18 C and cloudy in {city}"

    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", timeout=600, max_retries=0)
    agent = agents.Agent(name="weather", instructions="You answer questions about the weather.",
                         tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                         model=agents.OpenAIResponsesModel(model=server.name, openai_client=client),
                         model_settings=agents.ModelSettings(tool_choice="get_weather", temperature=0,
                                                             max_tokens=30))
    result = asyncio.run(agents.Runner.run(agent, HISTORY, max_turns=2))
    assert len(seen) == 1 and seen[0]
    assert result.final_output == f"18 C and cloudy in {seen[0]}"
