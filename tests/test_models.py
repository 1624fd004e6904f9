"""Each architecture on a tiny random config against transformers with identical weights.

float32 everywhere; quill's attention is SDPA and transformers' the eager path,
so results agree to float32 rounding (checked at rtol 1e-4, atol 1e-5).
"""

import pytest
import torch

from quill.engine.loader import build_model
from quill.errors import ModelError
from quill.formats.checkpoint import open_checkpoint
from quill.kernels import KernelPolicy, KernelSelector
from quill.models import model_module, supported_model_types
from quill.models.base import ForwardContext
from quill.platform import detect
from tests.model_util import MemoryCheckpoint, hf_model, save_hf_dir
from tests.padded_cache import KVCache

ARCHS = ["llama", "qwen2", "qwen3"]
TOL = dict(rtol=1e-4, atol=1e-5)


def selector(force: str | None = "reference") -> KernelSelector:
    return KernelSelector(detect(), KernelPolicy(force=force))


def load_dir(hf, tmp_path, force="reference", dtype=None):
    d = save_hf_dir(hf, tmp_path / "ckpt", tokenizer=False, dtype=dtype)
    return build_model(open_checkpoint(d), selector(force)).model


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits


def ids_of(length: int, batch: int = 1, seed: int = 1) -> torch.Tensor:
    return torch.randint(4, 320, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ARCHS + ["mistral"])
def test_logits_without_cache(arch, tmp_path):
    hf = hf_model(arch)
    model = load_dir(hf, tmp_path)
    assert model.args.context_length == 128  # a window is a per-layer attention band, not a context cap
    ids = ids_of(12, batch=2)
    got = model(ids, ForwardContext.causal(2, 12))
    ref = hf_logits(hf, ids)
    assert ref.std() > 0.1  # a real distribution, not near-uniform
    torch.testing.assert_close(got, ref, **TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_logits_with_cache_prefill_then_decode(arch, tmp_path):
    hf = hf_model(arch, seed=2)
    model = load_dir(hf, tmp_path)
    ids = ids_of(12, seed=3)
    args = model.args
    cache = KVCache(args.num_hidden_layers, torch.zeros(1), args.num_key_value_heads, args.head_dim, 4)
    parts = []
    for chunk in (ids[:, :7], *ids[:, 7:].split(1, dim=1)):  # prefill 7, then one token at a time
        parts.append(model(chunk, cache.context(chunk.shape[1])))
        cache.advance(chunk.shape[1])
    assert cache.length == 12 and cache.capacity >= 12  # grew from 4
    torch.testing.assert_close(torch.cat(parts, dim=1), hf_logits(hf, ids), **TOL)


@pytest.mark.parametrize("arch", ARCHS)
def test_batch_of_different_lengths(arch, tmp_path):
    hf = hf_model(arch, seed=4)
    model = load_dir(hf, tmp_path)
    a, b = ids_of(5, seed=5)[0], ids_of(11, seed=6)[0]
    nxt = ids_of(3, batch=2, seed=7)  # three decode steps for both rows
    args = model.args
    cache = KVCache(args.num_hidden_layers, torch.tensor([6, 0]), args.num_key_value_heads, args.head_dim, 16)
    batch = torch.stack([torch.cat([torch.full((6,), 3), a]), b])  # row 0 left-padded
    first = model(batch, cache.context(11))
    cache.advance(11)
    steps = []
    for t in range(3):
        steps.append(model(nxt[:, t:t + 1], cache.context(1)))
        cache.advance(1)
    for row, prompt, pad in ((0, a, 6), (1, b, 0)):
        full = torch.cat([prompt, nxt[row]])[None]
        ref = hf_logits(hf, full)[0]
        got = torch.cat([first[row, pad:], torch.cat(steps, dim=1)[row]])
        torch.testing.assert_close(got, ref, **TOL)


QUANT = {  # per module suffix: quantize_rtn settings covering sym/asym/act-order/8-bit
    "q_proj": dict(bits=4, group_size=16),
    "k_proj": dict(bits=4, group_size=32, symmetric=False),
    "v_proj": dict(bits=8, group_size=-1),
    "o_proj": dict(bits=4, group_size=16, act_order=True),
    "gate_proj": dict(bits=4, group_size=32),
    "up_proj": dict(bits=3, group_size=16, symmetric=False),
    "down_proj": dict(bits=4, group_size=32, offsets=True),
}


def quantized_checkpoint(hf, extra: dict | None = None, skip: tuple[str, ...] = ()) -> MemoryCheckpoint:
    state = {k: v.detach().clone() for k, v in hf.state_dict().items()}
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    plan = {}
    for name in state:
        module, suffix = name.removesuffix(".weight"), name.rsplit(".", 2)[-2]
        if name.endswith(".weight") and suffix in QUANT and module not in skip:
            plan[module] = QUANT[suffix]
    plan.update(extra or {})
    return MemoryCheckpoint(hf.config.to_dict(), state, plan)


def load_reference(hf, ckpt: MemoryCheckpoint):
    missing, unexpected = hf.load_state_dict(ckpt.reference_state(), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return hf


@pytest.mark.parametrize("arch", ARCHS)
def test_quantized_and_dense_layers_match(arch):
    hf = hf_model(arch, seed=8)
    # one projection left dense, as `ignore` / extra_config bits=16 leave some
    ckpt = quantized_checkpoint(hf, skip=("model.layers.1.mlp.gate_proj",))
    hf = load_reference(hf, ckpt)
    loaded = build_model(ckpt, selector())
    kinds = {i.name: i.kind for i in loaded.layers}
    assert kinds["model.layers.1.mlp.gate_proj"] == "dense" and kinds["model.layers.0.mlp.gate_proj"] == "quantized"
    ids = ids_of(10, batch=2, seed=9)
    ref = hf_logits(hf, ids)
    torch.testing.assert_close(loaded.model(ids, ForwardContext.causal(2, 10)), ref, **TOL)
    # the kernels a user gets by default agree to their own accuracy (SQNR-level, not bit-exact)
    fast = build_model(ckpt, selector(None)).model(ids, ForwardContext.causal(2, 10))
    assert (fast - ref).abs().max() < 0.02 * ref.abs().max()


def test_quantized_tied_embedding():
    """A quantized tied embedding (GGUF Q8_0 token_embd): rows dequantized on lookup, lm_head via a kernel."""
    hf = hf_model("qwen2", seed=10)
    assert hf.config.tie_word_embeddings
    ckpt = quantized_checkpoint(hf, extra={"model.embed_tokens": dict(bits=8, group_size=32)})
    hf = load_reference(hf, ckpt)
    loaded = build_model(ckpt, selector())
    assert loaded.model.model.embed_tokens.quantized is not None
    assert loaded.model.model.embed_tokens.weight is None  # no float copy of the table
    assert [i.kind for i in loaded.layers if i.name == "lm_head"] == ["tied"]
    ids = ids_of(9, batch=2, seed=11)
    torch.testing.assert_close(loaded.model(ids, ForwardContext.causal(2, 9)), hf_logits(hf, ids), **TOL)


def test_quantized_lm_head_untied():
    hf = hf_model("llama", seed=12)
    ckpt = quantized_checkpoint(hf, extra={"lm_head": dict(bits=8, group_size=32)})
    hf = load_reference(hf, ckpt)
    loaded = build_model(ckpt, selector())
    assert [i.kind for i in loaded.layers if i.name == "lm_head"] == ["quantized"]
    ids = ids_of(8, seed=13)
    torch.testing.assert_close(loaded.model(ids, ForwardContext.causal(1, 8)), hf_logits(hf, ids), **TOL)


def test_llama3_rope_scaling(tmp_path):
    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
    hf = hf_model("llama", seed=14, rope_parameters=rope)
    model = load_dir(hf, tmp_path)
    assert model.args.rope.kind == "llama3"
    torch.testing.assert_close(model.rotary.inv_freq, hf.model.rotary_emb.inv_freq, rtol=0, atol=0)
    ids = ids_of(60, seed=15)  # well past original_max_position_embeddings
    torch.testing.assert_close(model(ids, ForwardContext.causal(1, 60)), hf_logits(hf, ids), **TOL)


def test_bfloat16_compute(tmp_path):
    hf = hf_model("llama", seed=16)
    d = save_hf_dir(hf, tmp_path / "ckpt", tokenizer=False)
    model = build_model(open_checkpoint(d), selector(), dtype=torch.bfloat16).model
    ids = ids_of(10, seed=17)
    got, ref = model(ids, ForwardContext.causal(1, 10)), hf_logits(hf, ids)
    assert got.dtype == torch.float32  # logits are always float32
    assert (got - ref).abs().max() < 0.05 * ref.abs().max()


def test_model_args_from_dict():
    mod = model_module("qwen3")
    cfg = {"model_type": "qwen3", "hidden_size": 64, "num_hidden_layers": 1, "intermediate_size": 32,
           "num_attention_heads": 4, "vocab_size": 10, "head_dim": 32, "some_future_key": 1,
           "rope_theta": 1e6, "max_position_embeddings": 4096, "sliding_window": 1024,
           "layer_types": ["sliding_attention"]}
    args = mod.ModelArgs.from_dict(cfg)
    assert args.head_dim == 32 and args.num_key_value_heads == 4 and args.rope.theta == 1e6
    # transformers' Qwen convention: layer_types name local layers, use_sliding_window turns the window on
    assert args.context_length == 4096 and args.layer_window(0) is None
    assert mod.ModelArgs.from_dict({**cfg, "use_sliding_window": True}).layer_window(0) == 1024
    with pytest.raises(ModelError, match="required field.*hidden_size"):
        mod.ModelArgs.from_dict({k: v for k, v in cfg.items() if k != "hidden_size"})
    with pytest.raises(ModelError, match="rope type 'dynamic' is not supported; supported: default, linear, llama3, "
                                         "yarn"):
        mod.ModelArgs.from_dict({**cfg, "rope_scaling": {"rope_type": "dynamic", "factor": 4.0}})
    with pytest.raises(ModelError, match="num_attention_heads 4 is not a multiple of num_key_value_heads 3"):
        mod.ModelArgs.from_dict({**cfg, "num_key_value_heads": 3})


def test_unsupported_model_type_lists_supported():
    with pytest.raises(ModelError, match="model_type .gpt2. is not supported; supported: "
                       + ", ".join(supported_model_types())):
        model_module("gpt2")
    # the registry grows with each architecture: these stay, in sorted order
    assert {"gemma3", "gemma3_text", "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3",
            "qwen3_moe"} <= set(supported_model_types())
    assert supported_model_types() == sorted(supported_model_types())


def test_int8_activations_on_request():
    """activation="int8" (W4A8): every quantized layer's input is quantized per token, as compressed-tensors does."""
    hf = hf_model("llama", seed=18)
    ckpt = quantized_checkpoint(hf, skip=("model.layers.1.mlp.gate_proj",))
    hf = load_reference(hf, ckpt)

    def qdq(module, args):  # int8 symmetric per token, written out from compressed-tensors' formula
        x = args[0]
        s = x.abs().amax(-1, keepdim=True) / 127.5
        return (torch.round(torch.clamp(x / s, -128, 127)) * s,)
    for name in ckpt.layers:
        hf.get_submodule(name).register_forward_pre_hook(qdq)
    loaded = build_model(ckpt, selector(), activation="int8")
    quantized = [i for i in loaded.layers if i.kind == "quantized"]
    assert all(i.summary.startswith(("W4A8 dyn", "W3A8 dyn", "W8A8 dyn")) for i in quantized)
    ids = ids_of(10, batch=2, seed=19)
    err = (loaded.model(ids, ForwardContext.causal(2, 10)) - hf_logits(hf, ids)).abs().amax(-1)  # [2, 10]
    # SDPA vs eager attention can tip an activation sitting on a rounding boundary by one int8 step
    assert int((err > 1e-4).sum()) <= 2 and float(err.max()) < 2e-2, err
    plain = build_model(ckpt, selector()).model(ids, ForwardContext.causal(2, 10))
    assert float((plain - hf_logits(hf, ids)).abs().max()) > 1e-3  # the hooks (and int8) really change the result
