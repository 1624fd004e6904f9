"""Tools in chat templates (quill.chat_tools), tool-call parsers and the reasoning split, on the
shapes real models write (issue 42).

The templates are the real ones (tests/data/chat_templates, from llama.cpp's copies) and the default
model's own (SmolLM2's, which knows no tools: quill writes them in Hermes' format).  Streamed parsing
is checked by feeding answers a character at a time (the worst split) and comparing with the whole read.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from quill.default_model import default_model_path
from quill.engine.sampling import SamplingParams
from quill.formats.gguf.checkpoint import GGUFCheckpoint
from quill.serving.output_parser import OutputParser
from quill.serving.reasoning import reasoning_parser
from quill.serving.tool_parsers import parser_for_template, tool_parser
from quill.tokenizer import Tokenizer
from quill.tokenizer_spec import TokenizerSpec

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
HISTORY = [
    {"role": "user", "content": "Weather in Paris?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_abc123def456", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
    {"role": "tool", "tool_call_id": "call_abc123def456", "content": "22 C, sunny"},
]


def _template_tokenizer(name: str) -> Tokenizer:
    spec = TokenizerSpec(tokenizer=None, chat_template=(TEMPLATES / name).read_text(),
                         special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    return Tokenizer(spec)


@pytest.fixture(scope="module")
def smollm2() -> Tokenizer:
    return Tokenizer(GGUFCheckpoint(default_model_path()).tokenizer_spec())


# ---- templates ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name, call, result", [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
     "<tool_response>\n22 C, sunny\n</tool_response>"),
    ("Qwen-Qwen3-0.6B.jinja", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}',
     "<tool_response>\n22 C, sunny\n</tool_response>"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", '{"name": "get_weather", "parameters": {"city": "Paris"}}',
     "ipython<|end_header_id|>\n\n\"22 C, sunny\""),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja",
     '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}, "id": "123def456"}]',
     '"call_id": "123def456"'),  # ids cut to 9 characters
])
def test_templates_with_tools_render_tools_calls_and_results(name, call, result):
    text = _template_tokenizer(name).apply_chat_template(HISTORY, True, [WEATHER])
    assert '"description": "The weather in a city"' in text  # the tool definition, as the template writes it
    assert call in text  # arguments as a dict, not the client's JSON string quoted again
    assert result in text


def test_a_template_without_tools_gets_them_in_hermes_format(smollm2):
    """SmolLM2's template concatenates message['content']: null content and tool roles would fail or vanish."""
    text = smollm2.apply_chat_template(HISTORY, True, [WEATHER])
    assert text.startswith("<|im_start|>system\nYou are a function calling AI model.")
    assert json.dumps(WEATHER) in text
    assert '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n' \
           '</tool_call><|im_end|>' in text
    assert "<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response><|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")
    # the client's own system message comes first, the tools after it
    own = smollm2.apply_chat_template([{"role": "system", "content": "Be brief."}, *HISTORY[:1]], True, [WEATHER])
    assert own.startswith("<|im_start|>system\nBe brief.\n\nYou are a function calling AI model.")
    assert smollm2.apply_chat_template(HISTORY[:1], True) == smollm2.apply_chat_template(HISTORY[:1], True, None)


@pytest.mark.parametrize("name, parser", [
    ("Qwen-Qwen2.5-7B-Instruct.jinja", "hermes"), ("Qwen-Qwen3-0.6B.jinja", "hermes"),
    ("meta-llama-Llama-3.1-8B-Instruct.jinja", "llama3_json"),
    ("mistralai-Mistral-Nemo-Instruct-2407.jinja", "mistral"),
])
def test_the_parser_is_picked_from_the_template(name, parser):
    assert parser_for_template((TEMPLATES / name).read_text()) == parser


def test_the_default_models_template_gets_hermes_and_no_reasoning(smollm2):
    assert parser_for_template(smollm2.spec.chat_template) == "hermes"
    assert reasoning_parser("auto", smollm2.spec.chat_template) is None
    assert reasoning_parser("auto", (TEMPLATES / "Qwen-Qwen3-0.6B.jinja").read_text()).name == "qwen3"


# ---- parsers ------------------------------------------------------------------------------------

ANSWERS = {  # as the families write them (vLLM's parser tests use the same shapes)
    "hermes": ('I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
               '"days": [1, 2], "note": "say \\"hi\\" {}"}}\n</tool_call>\n<tool_call>\n'
               '{"name": "get_time", "arguments": {}}\n</tool_call>'),
    "llama3_json": '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": [1, 2], '
                   '"note": "say \\"hi\\" {}"}}; {"name": "get_time", "parameters": {}}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], '
               '"note": "say \\"hi\\" {}"}}, {"name": "get_time", "arguments": {}}]',
}
EXPECTED = [("get_weather", {"city": "Paris", "days": [1, 2], "note": 'say "hi" {}'}), ("get_time", {})]


def _streamed(parser: OutputParser, text: str) -> tuple[str, str, list[tuple[str, str]]]:
    events = [e for ch in text for e in parser.feed(ch)] + parser.finish()
    calls: dict[int, list[str]] = {}
    for e in events:
        if e.kind == "call":
            assert e.index not in calls and e.id.startswith("call_")
            calls[e.index] = [e.name, ""]
        elif e.kind == "args":
            calls[e.index][1] += e.text  # the name always came first
    text_of = lambda kind: "".join(e.text for e in events if e.kind == kind)  # noqa: E731
    return text_of("reasoning"), text_of("content"), [tuple(c) for c in calls.values()]


@pytest.mark.parametrize("family", list(ANSWERS))
def test_parsers_read_calls_whole_and_streamed(family):
    whole = OutputParser(tools=tool_parser(family)).read(ANSWERS[family])
    assert [(c.name, json.loads(c.arguments)) for _, c in whole.calls] == EXPECTED
    assert whole.content == ("I will look it up.\n" if family == "hermes" else "")
    assert len({i for i, _ in whole.calls}) == 2
    _, content, calls = _streamed(OutputParser(tools=tool_parser(family)), ANSWERS[family])
    assert content == whole.content
    assert calls == [(c.name, c.arguments) for _, c in whole.calls]


@pytest.mark.parametrize("text", [
    "The weather is fine, no tool needed.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut off by max_tokens
    "<tool_call>\nnot json at all\n</tool_call>",
])
def test_text_without_a_valid_call_is_content(text):
    whole = OutputParser(tools=tool_parser("hermes")).read(text)
    assert whole.calls == [] and whole.content == text


def test_other_key_orders_and_string_arguments_are_read():
    text = '<tool_call>{"arguments": "{\\"city\\": \\"Oslo\\"}", "name": "get_weather"}</tool_call>'
    (_, call), = OutputParser(tools=tool_parser("hermes")).read(text).calls
    assert call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    newer = tool_parser("mistral").parse('[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}', True)
    assert [(c.name, c.arguments) for c in newer.calls] == [("get_weather", '{"city": "Oslo"}')]


def test_a_required_calls_prefix_reads_as_the_answers_beginning():
    prefix = tool_parser("hermes").call_prefix("get_weather")
    answer = OutputParser(tools=tool_parser("hermes"), prefix=prefix).read('{"city": "Rome"}}\n</tool_call>')
    assert [(c.name, c.arguments) for _, c in answer.calls] == [("get_weather", '{"city": "Rome"}')]


def test_unknown_parsers_are_refused_by_name():
    from quill.errors import ConfigError
    with pytest.raises(ConfigError, match="unknown parser 'hermse'; known: hermes, llama3_json, mistral"):
        tool_parser("hermse")
    with pytest.raises(ConfigError, match="--reasoning-parser: unknown parser 'r1'"):
        reasoning_parser("r1", None)


# ---- reasoning ----------------------------------------------------------------------------------

THOUGHT = "<think>\nThe user wants the weather; I should call the tool.\n</think>\n\n"


@pytest.mark.parametrize("name, opened, text, reasoning, content", [
    ("qwen3", False, THOUGHT + "It is sunny.", "\nThe user wants the weather; I should call the tool.\n",
     "It is sunny."),
    ("qwen3", False, "No thought here.", None, "No thought here."),
    ("qwen3", True, "Thinking opened by the prompt.</think>Answer.", "Thinking opened by the prompt.", "Answer."),
    ("qwen3", False, "<think>cut off by max_tokens", "cut off by max_tokens", ""),
    ("deepseek_r1", False, "R1 thinks first.\n</think>\n\nAnswer.", "R1 thinks first.\n", "Answer."),
])
def test_reasoning_is_split_whole_and_streamed(name, opened, text, reasoning, content):
    whole = OutputParser(reasoning=reasoning_parser(name, None), opened=opened).read(text)
    assert (whole.reasoning, whole.content) == (reasoning, content)
    streamed = _streamed(OutputParser(reasoning=reasoning_parser(name, None), opened=opened), text)
    assert streamed[:2] == (reasoning or "", content)


def test_reasoning_then_a_tool_call():
    text = THOUGHT + '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    make = lambda: OutputParser(tools=tool_parser("hermes"), reasoning=reasoning_parser("qwen3", None))  # noqa: E731
    whole = make().read(text)
    assert whole.reasoning.strip().startswith("The user wants") and whole.content == ""
    assert [(c.name, c.arguments) for _, c in whole.calls] == [("get_weather", '{"city": "Paris"}')]
    assert _streamed(make(), text) == (whole.reasoning, "", [("get_weather", '{"city": "Paris"}')])


def test_a_prompt_that_opens_the_thought():
    qwq_like = "<|im_start|>assistant\n<think>\n"
    assert reasoning_parser("qwen3", None).opened_by(qwq_like)
    assert not reasoning_parser("qwen3", None).opened_by("<|im_start|>assistant\n")
    assert reasoning_parser("deepseek_r1", None).opened_by("<|im_start|>assistant\n")


def test_the_serve_flags_list_every_parser():
    from quill.cli.serve import REASONING_PARSERS, TOOL_PARSERS
    from quill.serving import reasoning, tool_parsers
    assert TOOL_PARSERS == tuple(tool_parsers.PARSERS) and REASONING_PARSERS == tuple(reasoning.PARSERS)


@pytest.mark.parametrize("family, generated", [
    ("hermes", '{"name": "get_weather", "arguments": {"city": "Oslo"}}'),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}'),
    ("mistral", '{"name": "get_weather", "arguments": {"city": "Oslo"}}'),
])
def test_a_forced_call_is_held_to_its_schema_and_closed(family, generated):
    """tool_choice required / named: the call's opening is in the prompt, the generated JSON is held to the
    schema (the engine's structured outputs), and the closing is added: the answer reads as one call."""
    from quill.serving.protocol_tools import FunctionName, NamedToolChoice
    from quill.serving.tool_calls import plan
    tools = [WEATHER, {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}]
    required = plan(tools, "required", tool_parser(family))
    assert [s["properties"]["name"] for s in required.schema["anyOf"]] == [{"const": "get_weather"},
                                                                           {"const": "get_time"}]
    answer = required.output_parser(None, False).read(generated)
    assert [(c.name, c.arguments) for _, c in answer.calls] == [("get_weather", '{"city": "Oslo"}')]
    named = plan(tools, NamedToolChoice(type="function", function=FunctionName(name="get_weather")),
                 tool_parser(family))
    assert named.schema == WEATHER["function"]["parameters"]
    answer = named.output_parser(None, False).read('{"city": "Oslo"}')
    assert [(c.name, c.arguments) for _, c in answer.calls] == [("get_weather", '{"city": "Oslo"}')]
    auto = plan(tools, "auto", tool_parser(family))
    assert auto.schema is None
    # Mistral's [TOOL_CALLS] is a special token: the answer's text must keep it
    assert auto.constrain(SamplingParams()).skip_special_tokens == (family != "mistral")
