"""Structured outputs and logit_bias in the engine core (quill.engine.structured), on the default model.

Every answer is checked by an independent reader (``json.loads`` + ``jsonschema``, ``re.fullmatch``);
batched, preempted and solo runs of the same greedy request must give the same tokens.
"""

import json
import re

import jsonschema
import pytest

import quill
from quill.engine.core import EngineConfig, EngineCore
from quill.engine.structured import StructuredOutputError, StructuredOutputs

pytest.importorskip("xgrammar")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"type": "string", "enum": ["admin", "user", "guest"]},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                                      "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
TOPICS = ["a software engineer", "a retired teacher", "a chef in Paris", "a student", "a pilot", "a farmer",
          "a doctor", "a musician", "a child", "a librarian"]
GREEDY = dict(temperature=0.0)


@pytest.fixture(scope="module")
def llm():
    return quill.LLM(None)


def chat(topic: str) -> list[dict]:
    return [{"role": "user", "content": f"Describe {topic} as JSON with name, age, role, address and tags."}]


def constrained(max_tokens: int = 120, **spec) -> quill.SamplingParams:
    return quill.SamplingParams(max_tokens=max_tokens, structured_outputs=StructuredOutputs(**spec), **GREEDY)


def test_json_schema_answers_validate(llm):
    outs = llm.chat([chat(t) for t in TOPICS], constrained(json=PERSON))
    for topic, out in zip(TOPICS, outs):
        assert out.finish_reason == "stop", (topic, out.text)
        jsonschema.validate(json.loads(out.text), PERSON)


def test_regex_choice_json_object_and_grammar(llm):
    specs = [dict(regex=r"[0-9]{3}-[0-9]{4}"), dict(choice=["yes", "no", "maybe not"]), dict(json_object=True),
             dict(grammar='root ::= "(" [a-z]+ ")"')]
    outs = llm.chat([[{"role": "user", "content": "What is your phone number?"}],
                     [{"role": "user", "content": "Is the sky green?"}],
                     [{"role": "user", "content": 'Answer with exactly this JSON: {"ok": true}'}],
                     [{"role": "user", "content": "Name a fruit."}]],
                    [constrained(60, **s) for s in specs])
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", outs[0].text)
    assert outs[1].text in ("yes", "no", "maybe not")
    assert isinstance(json.loads(outs[2].text), dict)
    assert re.fullmatch(r"\([a-z]+\)", outs[3].text)
    assert all(o.finish_reason == "stop" for o in outs), [(o.text, o.finish_reason) for o in outs]


def test_max_tokens_mid_json_is_length(llm):
    out = llm.chat(chat(TOPICS[0]), constrained(6, json=PERSON))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    with pytest.raises(ValueError):
        json.loads(out.text)  # truncated, as OpenAI documents


def test_mixed_batch_equals_solo_runs(llm):
    """Constrained and free requests batched together give what each gives alone (masks touch only their rows)."""
    prompts = [chat(t) for t in TOPICS[:2]] + [[{"role": "user", "content": "Tell me about the sea."}]] * 2
    params = [constrained(24, json=PERSON), constrained(24, regex=r"[A-Z][a-z ]+\."),
              quill.SamplingParams(max_tokens=16, **GREEDY), quill.SamplingParams(max_tokens=16, **GREEDY)]
    batched = llm.chat(prompts, params)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        assert llm.chat(p, sp)[0].token_ids == batched[i].token_ids, i


def test_preempted_equals_uninterrupted_under_a_constraint(llm):
    args = llm.model.args
    per_block = 2 * args.num_hidden_layers * 4 * args.num_key_value_heads * args.head_dim * 4  # float32 blocks of 4
    prompts = [llm.tokenizer.encode(f"{t.capitalize()} as JSON:") for t in TOPICS[:2]]  # short: cheap recomputes

    def run(core):
        for i, p in enumerate(prompts):
            core.add_request(str(i), p, constrained(16, json=PERSON))
        out = {}
        while core.has_unfinished_requests():
            for o in core.step():
                out.setdefault(o.request_id, []).extend(o.new_token_ids)
        return core, [out[str(i)] for i in range(len(prompts))]

    # a float32 cache: a recomputed prompt then reads back the keys and values decode wrote, not 16-bit roundings
    config = dict(block_size=4, enable_prefix_caching=False, kv_cache_dtype="float32")
    blocks = sum(-(-(len(p) + 16) // 4) for p in prompts) - 2  # both cannot run to the end at once
    roomy, want = run(EngineCore(llm.model, llm.eos_token_ids, llm.context_length,
                                 EngineConfig(**config, kv_cache_memory=4 * blocks * per_block),
                                 grammars=llm.engine.grammars))
    tight, got = run(EngineCore(llm.model, llm.eos_token_ids, llm.context_length,
                                EngineConfig(**config, kv_cache_memory=blocks * per_block),
                                grammars=llm.engine.grammars))
    assert roomy.stats().num_preemptions == 0 and tight.stats().num_preemptions > 0
    assert got == want


def test_invalid_specs_are_named_before_anything_is_queued(llm):
    bad = [(dict(json={"type": "nonsense"}), "invalid JSON schema"), (dict(regex="(ab"), "invalid regex"),
           (dict(grammar="root ::= "), "invalid EBNF grammar"), (dict(json='{"type": '), "not valid JSON")]
    for spec, words in bad:
        with pytest.raises(StructuredOutputError, match=words):
            llm.generate("hi", constrained(**spec))
        assert not llm.engine.has_unfinished_requests()
    with pytest.raises(StructuredOutputError, match="exactly one of"):
        StructuredOutputs(json=PERSON, regex="a+")


def test_a_schema_seen_before_is_not_compiled_again(llm):
    schema = {"type": "object", "properties": {f"field_{i}": {"type": "integer"} for i in range(40)},
              "required": ["field_0"]}
    before = llm.engine.stats().grammar_compiles
    llm.generate("x", constrained(4, json=schema))
    assert llm.engine.stats().grammar_compiles == before + 1
    llm.generate("y", constrained(4, json=json.dumps(schema)))  # the same schema, as text
    assert llm.engine.stats().grammar_compiles == before + 1


def test_a_compiling_request_can_be_aborted(llm):
    core = llm.engine
    core.add_request("c", llm.chat_prompt(chat("a cat")), constrained(8, regex=r"[a-z]{1,7}q"))
    assert core.has_unfinished_requests() and core.stats().num_waiting == 1  # waiting while it compiles
    assert core.abort_request("c")
    assert not core.has_unfinished_requests()


def test_logit_bias_bans_and_forces_tokens(llm):
    prompt = "The capital of France is"
    free = llm.generate(prompt, quill.SamplingParams(max_tokens=3, **GREEDY))[0].token_ids
    banned = llm.generate(prompt, quill.SamplingParams(max_tokens=3, logit_bias={free[0]: -100}, **GREEDY))[0]
    assert banned.token_ids[0] != free[0]
    forced = llm.tokenizer.encode(" banana")[0]
    out = llm.generate(prompt, quill.SamplingParams(max_tokens=3, logit_bias={forced: 100}, **GREEDY))[0]
    assert out.token_ids == [forced] * 3
    with pytest.raises(quill.errors.GenerationError, match="logit_bias"):
        llm.generate(prompt, quill.SamplingParams(logit_bias={10**7: 1.0}))
    with pytest.raises(quill.errors.GenerationError, match="logit_bias"):
        quill.SamplingParams(logit_bias={5: 101.0})
