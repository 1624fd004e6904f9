"""Qwen3.5 dense and MoE as GGUF files written by llama.cpp's own converter and quantizer (``qwen35`` /
``qwen35moe``), against transformers' float32 forward on the same (dequantized) weights.

The converter changes the checkpoint (conversion/qwen.py): zero-centred norms are stored as ``1 + w``, ``A_log``
as ``ssm_a = -exp(A_log)``, the conv weight squeezed to [C, K], and the value heads of every DeltaNet tensor
reordered from grouped by key head to tiled.  quill undoes the first three on load and runs the tiled order as
it is; the reference here puts the dequantized weights back in transformers' grouped order.
"""

from __future__ import annotations

import json

import pytest
import torch

import quill
from quill import native
from quill.formats.gguf.checkpoint import GGUFCheckpoint
from quill.models.base import ForwardContext
from quill.platform import detect
from tests.llamacpp_util import convert, quantize, save_smollm2_tokenizer
from tests.model_util import save_hf_dir
from tests.moe_models_util import fuse_experts
from tests.qwen3_5_util import COMMON, hf_qwen3_5

VOCAB = 49152  # the SmolLM2 tokenizer the converter recognises
PROMPT_LEN = 150  # longer than two chunks of 64


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_5_moe_text"])
def converted(request, tmp_path_factory):
    """(transformers model, {"F32" | "Q8_0" | "Q4_0": GGUF path}) of one architecture."""
    hf = hf_qwen3_5("moe" in request.param, seed=5, vocab_size=VOCAB)
    d = save_hf_dir(hf, tmp_path_factory.mktemp(request.param) / "hf", tokenizer=False)
    save_smollm2_tokenizer(d)
    # transformers loads a qwen3_5_moe_text directory's tokenizer as Qwen's own class whatever the files say,
    # whose pre-tokenizer the converter's hash check does not know: it converts under the dense type's name
    # (the converter picks the model by `architectures`; only the tokenizer reads model_type)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_5_text"}))
    f32 = convert(d, d / "f32.gguf", "f32", extra=("--no-mtp",))
    (d / "config.json").write_text(json.dumps(config))
    return hf, {"F32": f32, **{q: quantize(f32, d / f"{q}.gguf", q) for q in ("Q8_0", "Q4_0")}}


def grouped(name: str, t: torch.Tensor) -> torch.Tensor:
    """A DeltaNet tensor's value heads from the converter's tiled order back to transformers' grouped one."""
    hk, hv, dk, dv = (COMMON[k] for k in ("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim",
                                          "linear_value_head_dim"))
    rep = hv // hk

    def rows(x, size):  # [rep, Hk, size, ...] (tiled) -> [Hk, rep, size, ...] (grouped)
        return x.reshape(rep, hk, size, *x.shape[1:]).transpose(0, 1).reshape(x.shape)

    leaf = name.rpartition("linear_attn.")[2]
    if leaf == "in_proj_qkv.weight" or leaf == "conv1d.weight":
        qk = 2 * hk * dk
        return torch.cat([t[:qk], rows(t[qk:], dv)])
    if leaf == "in_proj_z.weight":
        return rows(t, dv)
    if leaf in ("in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias"):
        return rows(t, 1)
    if leaf == "out_proj.weight":
        return rows(t.T, dv).T
    return t


def reference(hf, path):
    """``hf`` with the GGUF file's weights, dequantized and in transformers' names, order and conventions."""
    ckpt = GGUFCheckpoint(path)
    state = {f"{m}.weight": qw.dequantize() for m, qw in ckpt.quantized_layers()}
    state.update(dict(ckpt.dense_tensors()))
    state = {k: grouped(k, t.float()) for k, t in fuse_experts(state).items()}
    # quill holds 1 + w where transformers adds the 1 itself: the file's norms are back to w here already
    ref = type(hf)(hf.config).eval()
    ref.load_state_dict(state, strict=True)
    return ref


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])  # F32 is what they are quantized from
def test_gguf_matches_transformers_on_its_weights(converted, qtype):
    hf, files = converted
    llm = quill.LLM(str(files[qtype]), skip_tokenizer_init=True, kv_cache_dtype="float32", activation_quant="exact")
    assert llm.model.args.model_type == hf.config.model_type
    ids = torch.randint(4, VOCAB, (1, PROMPT_LEN), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = torch.log_softmax(reference(hf, files[qtype])(ids).logits.float(), -1)[0]
    with torch.inference_mode():
        got = torch.log_softmax(llm.model(ids, ForwardContext.causal(1, PROMPT_LEN)), -1)[0]
    assert (got - want).abs().max() < 1e-3


def test_gguf_decodes_through_the_engine_as_the_full_forward(converted):
    """Prefill then decode steps (the recurrent state carried, value heads in the file's tiled order, decode
    tokens through the native update) give the tokens the whole-sequence forward picks."""
    _, files = converted
    llm = quill.LLM(str(files["Q8_0"]), skip_tokenizer_init=True, kv_cache_dtype="float32", activation_quant="none")
    recurrent = [layer.linear_attn for layer in llm.model.model.layers if layer.recurrent]
    assert recurrent and all(r.d.tiled for r in recurrent)
    if native.load().module is not None:
        assert all(r.isa == native.isa_for(detect()) for r in recurrent)
    ids = torch.randint(4, VOCAB, (20,), generator=torch.Generator().manual_seed(3)).tolist()
    params = quill.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    got = llm.generate([ids], params)[0].token_ids
    seq = list(ids)
    with torch.inference_mode():
        for _ in range(8):
            logits = llm.model(torch.tensor([seq]), ForwardContext.causal(1, len(seq)), all_logits=False)
            seq.append(int(logits[0, -1].argmax()))
    assert list(got) == seq[len(ids):]


def test_bench_writer_matches_the_converter(converted, tmp_path):
    """quill.bench.qwen35's random-weight files have the converter's metadata (the tokenizer's keys aside: the
    writer copies the default model's), tensor names, order, types and shapes for the same configuration."""
    from quill.bench.qwen35 import Qwen35Shape, write_qwen35_gguf
    from quill.engine.hub import default_model
    from quill.formats.gguf.file import GGUFFile
    from tests.qwen3_5_util import MOE

    hf, files = converted
    c = hf.config
    moe = dict(experts=MOE["num_experts"], experts_used=MOE["num_experts_per_tok"],
               expert_ffn=MOE["moe_intermediate_size"], shared_ffn=MOE["shared_expert_intermediate_size"])
    shape = Qwen35Shape("x", hidden=c.hidden_size, layers=c.num_hidden_layers, ffn=c.intermediate_size,
                        heads=c.num_attention_heads, kv_heads=c.num_key_value_heads, head_dim=c.head_dim,
                        lin_k_heads=c.linear_num_key_heads, lin_v_heads=c.linear_num_value_heads,
                        lin_k_dim=c.linear_key_head_dim, lin_v_dim=c.linear_value_head_dim, vocab=VOCAB, tied=False,
                        rope_theta=10000.0, context=c.max_position_embeddings, **(moe if "moe" in c.model_type else {}))
    want, got = (GGUFFile(p) for p in (files["F32"], write_qwen35_gguf(tmp_path, shape, default_model(), f32=True)))

    def meta(f):  # quill's reader: a fraction of gguf-py's time on a 49k-token vocabulary
        return {k: (f.value_types[k], v) for k, v in f.metadata.items()
                if not k.startswith("tokenizer.") and k != "general.name"}

    assert list(meta(got).items()) == list(meta(want).items())  # keys in the same order too
    assert [(i.name, i.ggml_type, i.shape) for i in got.tensors.values()] == \
        [(i.name, i.ggml_type, i.shape) for i in want.tensors.values()]
