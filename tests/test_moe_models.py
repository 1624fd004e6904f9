"""MoE architectures on tiny random configs against transformers with identical weights.

Dense (float) experts through save_pretrained, and quantized experts of mixed
formats through an in-memory checkpoint, each compared with the transformers
twin (float32; quill's attention is SDPA, the twin's eager).
"""

import json

import pytest
import torch

import quill
from quill.engine.loader import build_model
from quill.errors import CheckpointError, ModelError
from quill.formats.checkpoint import open_checkpoint
from quill.kernels import KernelPolicy, KernelSelector
from quill.layers import SparseMoeBlock
from quill.models import model_module
from quill.models.base import ForwardContext
from quill.moe import MoESelector
from quill.platform import detect
from tests.model_util import MemoryCheckpoint, save_hf_dir
from tests.moe_models_util import MOE_ARCHS, fuse_experts, hf_moe_model, split_experts
from tests.padded_cache import KVCache

TOL = dict(rtol=1e-4, atol=1e-5)


def selectors(kernel: str | None = "reference", moe: str | None = None):
    # exact_float: native float kernels in their exact mode (the 24-bit image), as these compare with transformers
    return (KernelSelector(detect(), KernelPolicy(force=kernel), exact_float=True),
            MoESelector(detect(), KernelPolicy(force=moe)))


def ids_of(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, 320, (batch, length), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(ids).logits


def load(ckpt, kernel="reference", moe=None, dtype=torch.float32):
    lin, moe_sel = selectors(kernel, moe)
    return build_model(ckpt, lin, dtype=dtype, moe_selector=moe_sel)


def moe_blocks(model) -> list[SparseMoeBlock]:
    return [m for m in model.modules() if isinstance(m, SparseMoeBlock)]


# ---- dense experts, real checkpoint files -----------------------------------------

@pytest.fixture(scope="module", params=MOE_ARCHS)
def saved(request, tmp_path_factory):
    arch = request.param
    hf = hf_moe_model(arch, seed=3)
    d = save_hf_dir(hf, tmp_path_factory.mktemp(arch) / "ckpt", tokenizer=False)
    return arch, hf, d


def test_layer_structure_follows_config(saved):
    arch, hf, d = saved
    loaded = load(open_checkpoint(d))
    kinds = ["moe" if isinstance(getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe"), SparseMoeBlock)
             else "dense" for layer in loaded.model.model.layers]
    want = {"mixtral": ["moe", "moe"], "qwen2_moe": ["moe", "dense", "moe"],
            "qwen3_moe": ["dense", "moe", "dense", "moe"]}[arch]
    assert kinds == want
    hf_kinds = ["moe" if hasattr(layer.mlp, "experts") else "dense" for layer in hf.model.layers]
    assert hf_kinds == want
    experts = [i for i in loaded.layers if i.kind == "expert"]
    assert experts and all(i.kernel == "moe:grouped" and i.summary.startswith("dense float32") for i in experts)


@pytest.mark.parametrize("kernel,moe", [("reference", "reference"), ("reference", "grouped"), (None, None)])
def test_dense_experts_logits(saved, kernel, moe):
    arch, hf, d = saved
    model = load(open_checkpoint(d), kernel, moe).model
    ids = ids_of(12, batch=2)
    ref = hf_logits(hf, ids)
    assert ref.std() > 0.1
    torch.testing.assert_close(model(ids, ForwardContext.causal(2, 12)), ref, **TOL)


def test_prefill_then_decode_with_cache(saved):
    arch, hf, d = saved
    model = load(open_checkpoint(d), None).model  # default kernels: the decode path of the grouped backend
    ids = ids_of(10, seed=4)
    a = model.args
    cache = KVCache(a.num_hidden_layers, torch.zeros(1), a.num_key_value_heads, a.head_dim, 4)
    parts = []
    for chunk in (ids[:, :6], *ids[:, 6:].split(1, dim=1)):
        parts.append(model(chunk, cache.context(chunk.shape[1])))
        cache.advance(chunk.shape[1])
    torch.testing.assert_close(torch.cat(parts, dim=1), hf_logits(hf, ids), **TOL)


def test_greedy_generation_matches_transformers(saved):
    arch, hf, d = saved
    llm = quill.LLM(str(d), skip_tokenizer_init=True, kv_cache_dtype="float32")  # transformers' float cache
    prompts = [[5, 17, 99, 42], [8, 9, 10, 11, 12, 13, 200]]
    outs = llm.generate(prompts, quill.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        seq = list(p)
        with torch.no_grad():
            for _ in range(8):
                seq.append(int(hf(torch.tensor([seq])).logits[0, -1].argmax()))
        assert o.token_ids == seq[len(p):]


def test_bfloat16_compute(saved):
    arch, hf, d = saved
    model = load(open_checkpoint(d), None, dtype=torch.bfloat16).model
    ids = ids_of(8, seed=5)
    got, ref = model(ids, ForwardContext.causal(1, 8)), hf_logits(hf, ids)
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


# ---- quantized experts of several formats -------------------------------------------

EXPERT_FORMATS = [  # gate, up, down per expert, cycling: sym/asym/offsets/8-bit/act-order/3-bit
    (dict(bits=4, group_size=16), dict(bits=4, group_size=16), dict(bits=4, group_size=16)),
    (dict(bits=4, group_size=32, symmetric=False), dict(bits=4, group_size=32), dict(bits=8, group_size=-1)),
    (dict(bits=4, group_size=16, act_order=True), dict(bits=4, group_size=16, act_order=True),
     dict(bits=4, group_size=16, offsets=True)),
    (dict(bits=3, group_size=16, symmetric=False), dict(bits=8, group_size=32, symmetric=False),
     dict(bits=4, group_size=-1)),
]
ATTN = {"q_proj": dict(bits=4, group_size=16), "k_proj": dict(bits=4, group_size=32, symmetric=False),
        "v_proj": dict(bits=8, group_size=-1), "o_proj": dict(bits=4, group_size=16)}


def quantized_checkpoint(hf, dense_expert: str | None = None) -> MemoryCheckpoint:
    state = split_experts({k: v.detach().clone() for k, v in hf.state_dict().items()})
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    plan = {}
    for name in state:
        module = name.removesuffix(".weight")
        parts = module.split(".")
        if "experts" in parts and module != dense_expert:
            e = int(parts[parts.index("experts") + 1])
            proj = ("gate_proj", "up_proj", "down_proj").index(parts[-1])
            plan[module] = EXPERT_FORMATS[e % len(EXPERT_FORMATS)][proj]
        elif parts[-1] in ATTN:
            plan[module] = ATTN[parts[-1]]
    return MemoryCheckpoint(hf.config.to_dict(), state, plan)


def load_reference(hf, ckpt: MemoryCheckpoint):
    missing, unexpected = hf.load_state_dict(fuse_experts(ckpt.reference_state()), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return hf


@pytest.mark.parametrize("arch", MOE_ARCHS)
def test_quantized_experts_match_transformers(arch):
    hf = hf_moe_model(arch, seed=6)
    layer = 1 if arch == "qwen3_moe" else 0  # the first sparse layer
    # one expert projection left in float, as `ignore` lists may leave some
    ckpt = quantized_checkpoint(hf, dense_expert=f"model.layers.{layer}.mlp.experts.1.up_proj")
    hf = load_reference(hf, ckpt)
    ids = ids_of(10, batch=2, seed=7)
    ref = hf_logits(hf, ids)
    exact = load(ckpt, "reference", "reference")
    kinds = {i.name: i.summary for i in exact.layers if i.kind == "expert"}
    prefix = f"model.layers.{layer}." + ("block_sparse_moe" if arch == "mixtral" else "mlp")
    up = "w3" if arch == "mixtral" else "up_proj"
    assert kinds[f"{prefix}.experts.1.{up}"].startswith("dense") and "act-order" in kinds[f"{prefix}.experts.2.{up}"]
    torch.testing.assert_close(exact.model(ids, ForwardContext.causal(2, 10)), ref, **TOL)
    torch.testing.assert_close(load(ckpt, "reference", "grouped").model(ids, ForwardContext.causal(2, 10)), ref,
                               **TOL)
    fast = load(ckpt, None, None).model(ids, ForwardContext.causal(2, 10))  # what a user gets by default
    close_but_routing_may_flip(fast, ref)


def close_but_routing_may_flip(got: torch.Tensor, want: torch.Tensor) -> None:
    """Logits [B, T, V] from inexact kernels: close at most positions.

    Top-k routing is discontinuous: a router-logit error of a few hundredths
    (bf16 activations in the dense fallback of the torch kernel) can swap the
    k-th and (k+1)-th expert of a token whose two scores were that close, which
    moves that token's logits (and, through attention, a little of the later
    ones) by far more than the kernel error.  Allow that at a few positions.
    """
    err = (got - want).abs().amax(-1).flatten()  # [B*T]
    scale = want.abs().max()
    assert float((err < 0.02 * scale).float().mean()) >= 0.75, err
    assert float(err.max()) < 0.25 * scale, err


def test_int8_activations_reach_the_experts():
    hf = hf_moe_model("qwen3_moe", seed=8)
    ckpt = quantized_checkpoint(hf)
    lin, moe = selectors("reference", "grouped")
    loaded = build_model(ckpt, lin, activation="int8", moe_selector=moe)
    block = moe_blocks(loaded.model)[0]
    assert block.fused.config.act.value == "int8_dynamic_token"
    ids = ids_of(6, seed=9)
    plain = load(ckpt, "reference").model(ids, ForwardContext.causal(1, 6))
    a8 = loaded.model(ids, ForwardContext.causal(1, 6))
    assert 0 < (a8 - plain).abs().max() < 0.05 * plain.abs().max()


# ---- config and checkpoint errors ---------------------------------------------------

def test_moe_config_fields():
    mod = model_module("qwen3_moe")
    cfg = dict(model_type="qwen3_moe", hidden_size=64, num_hidden_layers=4, intermediate_size=96,
               num_attention_heads=4, vocab_size=10, num_local_experts=8, num_experts_per_tok=2,
               moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3])
    args = mod.ModelArgs.from_dict(cfg)
    assert args.num_experts == 8 and [args.is_sparse(i) for i in range(4)] == [False, True, False, False]
    with pytest.raises(ModelError, match="num_experts 6 and num_local_experts 8 disagree"):
        mod.ModelArgs.from_dict({**cfg, "num_experts": 6})
    with pytest.raises(ModelError, match="num_experts_per_tok 9 exceeds the 8 experts"):
        mod.ModelArgs.from_dict({**cfg, "num_experts_per_tok": 9})
    with pytest.raises(ModelError, match="'mlp_only_layers': \\[7\\] are not layer indices in \\[0, 4\\)"):
        mod.ModelArgs.from_dict({**cfg, "mlp_only_layers": [7]})
    with pytest.raises(ModelError, match="'moe_intermediate_size': expected a positive integer, found 0"):
        mod.ModelArgs.from_dict({**cfg, "moe_intermediate_size": 0})


def _with_config(ckpt: MemoryCheckpoint, **changes) -> MemoryCheckpoint:
    ckpt.config = {**ckpt.config, **changes}
    return ckpt


def test_config_expert_count_disagrees_with_the_tensors():
    """The router is the first tensor sized by the expert count: its error names the layer and both counts."""
    hf = hf_moe_model("qwen3_moe", seed=10)
    ckpt = _with_config(quantized_checkpoint(hf), num_experts=10, num_local_experts=10)
    with pytest.raises(CheckpointError, match="tensor 'model.layers.1.mlp.gate.weight' has shape \\[8, 64\\], the "
                                              "model expects \\[10, 64\\]"):
        load(ckpt)
    hf = hf_moe_model("mixtral", seed=11)
    ckpt = _with_config(quantized_checkpoint(hf), num_local_experts=3)
    with pytest.raises(CheckpointError, match="'model.layers.0.block_sparse_moe.gate.weight' has shape \\[4, 64\\]"):
        load(ckpt)
    # a router that agrees with the config but experts that do not: the extra experts are named
    ckpt = _with_config(quantized_checkpoint(hf), num_local_experts=3)
    for layer in range(2):
        ckpt.dense[f"model.layers.{layer}.mlp.gate.weight"] = ckpt.dense[f"model.layers.{layer}.mlp.gate.weight"][:3]
    with pytest.raises(CheckpointError, match="no place for: model.layers.0.block_sparse_moe.experts.3.w1 "
                                              "\\(quantized layer\\)"):
        load(ckpt)


def test_whole_experts_missing_are_listed():
    hf = hf_moe_model("qwen3_moe", seed=10)
    ckpt = quantized_checkpoint(hf)
    for e in (6, 7):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            del ckpt.layers[f"model.layers.3.mlp.experts.{e}.{proj}"]
    with pytest.raises(CheckpointError, match="model.layers.3.mlp: the config says 8 experts, but the checkpoint "
                                              "lacks 6 expert projection\\(s\\), first 'model.layers.3.mlp.experts."
                                              "6.gate_proj'; experts with no tensors at all: \\[6, 7\\]"):
        load(ckpt)


def test_missing_expert_tensor_is_named():
    hf = hf_moe_model("qwen2_moe", seed=12)
    ckpt = quantized_checkpoint(hf)
    del ckpt.layers["model.layers.2.mlp.experts.4.up_proj"]
    with pytest.raises(CheckpointError, match="model.layers.2.mlp: .*lacks 1 expert projection\\(s\\), first "
                                              "'model.layers.2.mlp.experts.4.up_proj'$"):
        load(ckpt)


def test_expert_of_the_wrong_shape_is_named(tmp_path):
    hf = hf_moe_model("qwen3_moe", seed=13)
    d = save_hf_dir(hf, tmp_path / "ckpt", tokenizer=False)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "moe_intermediate_size": 16}))
    with pytest.raises(CheckpointError, match="tensor 'model.layers.1.mlp.experts.0.down_proj.weight' has shape "
                                              "\\[64, 32\\], the model expects \\[64, 16\\]"):
        load(open_checkpoint(d))
