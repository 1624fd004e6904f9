"""Fused experts: the grouped backend against the per-expert reference loop, for every format shape and routing."""

import pytest
import torch
import torch.nn.functional as F

from quill import native
from quill.errors import CheckpointError, ConfigError, KernelError, ModelError
from quill.moe import ExpertWeights, MoELayerConfig, route, stack_gate_up
from quill.moe.experts import check_experts
from quill.platform import detect
from tests.moe_util import FORMATS, PLAT, build, make_experts, sqnr_db

E, H, I = 8, 128, 64


def _routing(T: int, k: int, seed: int = 1, num_experts: int = E):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, num_experts, generator=gen)
    return route(logits, k, renormalize=True)


def _x(T: int, seed: int = 2, dtype=torch.float32):
    return torch.randn(T, H, generator=torch.Generator().manual_seed(seed)).to(dtype)


def naive_moe(experts, x, ids, weights):
    """Definition, token by token and slot by slot, from dequantized float32 weights."""
    y = torch.zeros(x.shape[0], x.shape[1])
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            ex = experts[int(ids[t, j])]
            g, u, d = (p.dequantize() for p in (ex.gate, ex.up, ex.down))
            h = F.silu(x[t].float() @ g.T) * (x[t].float() @ u.T)
            y[t] += float(weights[t, j]) * (h @ d.T)
    return y


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_reference_backend_is_the_definition(fmt):
    experts = make_experts(4, H, I, FORMATS[fmt], seed=3)
    w, ids = _routing(5, 2, num_experts=4)
    x = _x(5)
    got = build(experts, 2, "reference")(x, ids, w)
    torch.testing.assert_close(got, naive_moe(experts, x, ids, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("T", [1, 7])
def test_grouped_matches_reference(fmt, top_k, T):
    experts = make_experts(E, H, I, FORMATS[fmt], seed=4)
    ref, fast = build(experts, top_k, "reference"), build(experts, top_k, "grouped")
    w, ids = _routing(T, top_k)
    x = _x(T)
    assert fast.backend_name == "grouped" and ref.backend_name == "reference"
    assert sqnr_db(ref(x, ids, w), fast(x, ids, w)) >= 40


@pytest.mark.parametrize("fmt", ["w4-sym-g32", "w8-sym-channel", "w4-actorder-g32"])
def test_int8_activations_w4a8(fmt):
    experts = make_experts(E, H, I, FORMATS[fmt], seed=5)
    ref, fast = build(experts, 2, "reference", "int8"), build(experts, 2, "grouped", "int8")
    assert fast.config.act.value == "int8_dynamic_token"
    w, ids = _routing(6, 2)
    x = _x(6)
    out_ref = ref(x, ids, w)
    # the activation quantization really happens: the float-activation result differs
    assert sqnr_db(build(experts, 2, "reference")(x, ids, w), out_ref) < 60
    assert sqnr_db(out_ref, fast(x, ids, w)) >= 30  # int8 rounding of the intermediate may flip a level


def test_mixed_formats_in_one_layer():
    experts = make_experts(E, H, I, FORMATS["w4-sym-g32"], seed=6, down_fmt=FORMATS["w8-sym-channel"])
    fast, ref = build(experts, 2, "grouped"), build(experts, 2, "reference")
    assert not fast.config.uniform and fast.config.bits == 8 and "mixed" in fast.config.summary()
    w, ids = _routing(4, 2)
    x = _x(4)
    assert sqnr_db(ref(x, ids, w), fast(x, ids, w)) >= 40


def test_one_expert_takes_every_token_others_none():
    experts = make_experts(E, H, I, FORMATS["w4-asym-g32"], seed=7)
    T = 9
    ids = torch.tensor([[5, 2]] * T)
    w = torch.tensor([[0.75, 0.25]] * T)
    x = _x(T)
    ref, fast = build(experts, 2, "reference")(x, ids, w), build(experts, 2, "grouped")(x, ids, w)
    assert sqnr_db(ref, fast) >= 40
    ids1 = torch.full((T, 1), 3)
    w1 = torch.ones(T, 1)
    ref1, fast1 = build(experts, 1, "reference")(x, ids1, w1), build(experts, 1, "grouped")(x, ids1, w1)
    assert sqnr_db(ref1, fast1) >= 40
    torch.testing.assert_close(ref1, naive_moe(experts, x, ids1, w1), rtol=1e-5, atol=1e-5)


def test_no_tokens_and_unused_experts_cost_nothing():
    experts = make_experts(E, H, I, FORMATS["w4-sym-g32"], seed=8)
    moe = build(experts, 2, "grouped")
    empty = moe(torch.zeros(0, H), torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2))
    assert empty.shape == (0, H)
    ids = torch.tensor([[0, 1], [1, 0]])
    assert moe.bytes_read(ids) == moe.expert_bytes[0] + moe.expert_bytes[1]


@pytest.mark.parametrize("T", [1, 5])
def test_bfloat16_activations(T):
    experts = make_experts(E, H, I, FORMATS["w4-sym-g32"], seed=9)
    w, ids = _routing(T, 2)
    x = _x(T, dtype=torch.bfloat16)
    ref = build(experts, 2, "reference")(x.float(), ids, w)
    out = build(experts, 2, "grouped", dtype=torch.bfloat16)(x, ids, w)
    assert out.dtype == torch.bfloat16
    assert sqnr_db(ref, out.float()) >= 30  # bf16 output rounding alone is ~2^-9 relative


def test_decode_reads_only_selected_experts():
    """An expert no token chose is never called (its linears would raise).  The per-expert path: the native
    group indexes the routed experts directly (test_native_expert_group_is_the_per_expert_path)."""
    experts = make_experts(4, H, I, FORMATS["w4-sym-g32"], seed=10)
    moe = build(experts, 2, "grouped")
    moe.state.group = None

    def boom(x):
        raise AssertionError("an unselected expert ran")

    moe.state.experts[3].down = boom
    for T in (1, 5):
        ids = torch.tensor([[0, 2]] * T)
        moe(_x(T), ids, torch.full((T, 2), 0.5))
    with pytest.raises(AssertionError, match="unselected"):
        moe(_x(1), torch.tensor([[3, 0]]), torch.full((1, 2), 0.5))


# ---- act-order ----------------------------------------------------------------

def test_act_order_gate_up_with_different_g_idx_are_not_stacked():
    experts = make_experts(E, H, I, FORMATS["w4-actorder-g32"], seed=11)
    assert not torch.equal(experts[0].gate.g_idx, experts[0].up.g_idx)
    fast = build(experts, 2, "grouped")
    assert fast.state.experts[0].gate_up is None and fast.state.experts[0].gate is not None
    # GPTQ usually shares one column order between gate and up (same input): then they stack
    shared = [ExpertWeights(ex.gate, ex.up.with_(codes=ex.up.codes, g_idx=ex.gate.g_idx), ex.down)
              for ex in experts]
    fast_shared = build(shared, 2, "grouped")
    assert fast_shared.state.experts[0].gate_up is not None
    w, ids = _routing(6, 2)
    x = _x(6)
    assert sqnr_db(build(shared, 2, "reference")(x, ids, w), fast_shared(x, ids, w)) >= 40


# ---- stacking gate and up -------------------------------------------------------

@pytest.mark.parametrize("fa,fb", [("w4-sym-g32", "w4-sym-g32"), ("w4-asym-g32", "w4-asym-g32"),
                                   ("w4-sym-g32", "w4-asym-g32"), ("w4-offsets-g32", "w4-sym-g32"),
                                   ("bf16", "bf16"), ("bf16", "fp32")])
def test_stacking_is_exact(fa, fb):
    gen = torch.Generator().manual_seed(12)
    a = make_experts(1, H, I, FORMATS[fa], seed=1)[0].gate
    b = make_experts(1, H, I, FORMATS[fb], seed=2)[0].up
    s = stack_gate_up(a, b, "x.gate_up_proj")
    assert s is not None and (s.out_features, s.in_features) == (2 * I, H)
    assert torch.equal(s.dequantize(), torch.cat([a.dequantize(), b.dequantize()]))
    del gen


def test_stacking_refuses_what_cannot_share_a_layout():
    sym = make_experts(1, H, I, FORMATS["w4-sym-g32"], seed=1)[0]
    w8 = make_experts(1, H, I, FORMATS["w8-sym-channel"], seed=1)[0]
    dense = make_experts(1, H, I, torch.bfloat16, seed=1)[0]
    assert stack_gate_up(sym.gate, w8.up, "x") is None
    assert stack_gate_up(sym.gate, dense.up, "x") is None
    from quill.canonical import ActivationQuant
    a = sym.gate.with_(activation=ActivationQuant(dynamic=False, scale=0.1))
    b = sym.up.with_(activation=ActivationQuant(dynamic=False, scale=0.2))
    assert stack_gate_up(a, b, "x") is None  # two static input scales cannot share one input


# ---- config, router, bad input --------------------------------------------------

def test_config_summary_and_fields():
    cfg = MoELayerConfig.from_experts(make_experts(4, H, I, FORMATS["w4-asym-g32"]), 2, PLAT)
    assert (cfg.num_experts, cfg.top_k, cfg.hidden_size, cfg.intermediate_size) == (4, 2, H, I)
    assert cfg.summary() == f"MoE 4x top2 W4A16 g32 asym {H}->{I}" and cfg.uniform
    dense = MoELayerConfig.from_experts(make_experts(4, H, I, torch.bfloat16), 1, PLAT)
    assert dense.dense and dense.summary() == f"MoE 4x top1 dense fp16 {H}->{I}"


def test_router_softmax_topk_renormalize():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    w, ids = route(logits, 2, renormalize=False)
    p = torch.softmax(logits, -1)
    assert ids.tolist() == [[1, 2]]
    torch.testing.assert_close(w, p[:, [1, 2]])
    wn, _ = route(logits, 2, renormalize=True)
    torch.testing.assert_close(wn.sum(-1), torch.ones(1))
    with pytest.raises(ModelError, match="scoring 'sigmoid' is not supported; supported: softmax"):
        route(logits, 2, True, scoring="sigmoid")


@pytest.mark.skipif(native.load().module is None, reason="native kernels not built")
@pytest.mark.parametrize("renormalize", [False, True])
def test_native_router_is_torch_softmax_topk(renormalize):
    """The extension's router (route() uses it; the native decode step routes with the same function) picks
    the k largest logits, best first, ties to the lower id, with torch's softmax probabilities to float32
    rounding."""
    ext = native.load().module
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(64, 128, generator=gen) * 4
    logits[3, [7, 9, 40]] = 50.0  # a three-way tie at the top
    logits[4] = 0.0  # every expert tied
    w, ids = ext.moe_route(logits, 8, renormalize)
    assert ids.dtype == torch.long and w.dtype == torch.float32 and w.shape == ids.shape == (64, 8)
    probs = torch.softmax(logits.double(), -1)
    want_w, want_ids = torch.topk(probs, 8, -1)
    assert torch.equal(ids[:3], want_ids[:3]) and torch.equal(ids[5:], want_ids[5:])
    assert ids[3, :3].tolist() == [7, 9, 40] and ids[4].tolist() == list(range(8))
    if renormalize:
        want_w = want_w / want_w.sum(-1, keepdim=True)
    torch.testing.assert_close(w, want_w.float(), rtol=2e-7, atol=1e-9)
    torch.testing.assert_close(route(logits, 8, renormalize)[0], w, rtol=0, atol=0)
    with pytest.raises(KernelError, match=r"moe_route: top_k 9 should be in \[1, 8\]"):
        ext.moe_route(logits[:, :8].contiguous(), 9, True)


def test_bad_expert_sets_name_layer_and_expert():
    experts = make_experts(4, H, I, FORMATS["w4-sym-g32"])
    with pytest.raises(ConfigError, match="model.layers.3.mlp: the config says 8 experts, the checkpoint provides 4"):
        check_experts("model.layers.3.mlp", experts, 8, H, I)
    with pytest.raises(CheckpointError, match="model.layers.3.mlp: expert 2 down_proj is \\[64, 64\\]"):
        bad = experts[:2] + [ExpertWeights(experts[2].gate, experts[2].up,
                                           make_experts(1, I, I, FORMATS["w4-sym-g32"])[0].gate)] + experts[3:]
        check_experts("model.layers.3.mlp", bad, 4, H, I)
    with pytest.raises(ModelError, match="top_k 5 with 4 experts"):
        build(experts, 5, "grouped")
    with pytest.raises(ModelError, match="activation 'gelu' is not supported"):
        MoELayerConfig.from_experts(experts, 2, PLAT, hidden_act="gelu")
    moe = build(experts, 2, "grouped")
    with pytest.raises(KernelError, match="expected x \\[T, 128\\]"):
        moe(torch.zeros(3, H + 1), torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 2))


# ---- the native expert group (one token, one call) -----------------------------------------

@pytest.mark.parametrize("isa", ["avx2", "native"])
@pytest.mark.parametrize("fmt,activation", [("w4-sym-g32", None), ("w4-asym-g32", None), ("w4-sym-g32", "int8"),
                                            ("w8-sym-channel", None), ("w2-asym-g32", None), ("bf16", None)])
def test_native_expert_group_is_the_per_expert_path(fmt, activation, isa):
    """One token's routed experts in one native call give the per-expert path's result (same linears, same
    silu-mul; only the weighted sum's rounding may differ) for routings that repeat and reorder experts;
    on the AVX2 kernels and on this CPU's own (AVX-512 where it has it)."""
    experts = make_experts(E, H, I, FORMATS[fmt], seed=12)
    moe = build(experts, 3, "grouped", activation, platform=PLAT if isa == "avx2" else detect())
    group = moe.state.group
    assert group is not None and group.num_experts == E
    op = moe.state.experts[0].gate_up
    assert fmt == "bf16" or (op.state.handle.isa == "avx2") == (isa == "avx2" or not detect().has("avx512f"))
    x = _x(1, seed=13)
    # k = 2, 4: whole experts per thread on two threads (moe.cpp's solo); k = 3, 1: each linear split
    for ids in ([[0, 5, 7]], [[7, 5, 0]], [[2, 2, 4]], [[6]], [[0, 5]], [[7, 5, 2, 2]]):
        ids = torch.tensor(ids)
        w = torch.rand(ids.shape, generator=torch.Generator().manual_seed(int(ids.sum()))) + 0.1
        got = moe(x, ids, w)
        assert torch.equal(got, group.forward(x, ids, w, team=False))
        moe.state.group = None
        want = moe(x, ids, w)
        moe.state.group = group
        assert got.shape == (1, H) and got.dtype == torch.float32
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        ref = naive_moe(experts, x, ids, w)
        assert sqnr_db(ref, got) >= (40 if activation is None else 25)


@pytest.mark.parametrize("fmt,activation", [("w4-sym-g32", None), ("w4-asym-g32", "int8"), ("bf16", None)])
def test_native_expert_group_takes_many_tokens(fmt, activation):
    """Several tokens in one call (prefill, batched decode): each expert that received tokens runs once on
    all of them; the result is the per-expert Python path's to float32 rounding, and one parallel region
    gives the bits of the linears' own calls (team=False), repeated experts in a token included."""
    experts = make_experts(E, H, I, FORMATS[fmt], seed=16)
    moe = build(experts, 3, "grouped", activation)
    group = moe.state.group
    for T in (2, 7, 40):
        x = _x(T, seed=T)
        w, ids = _routing(T, 3, seed=T)
        ids[0] = torch.tensor([4, 4, 1])  # a repeated expert
        got = moe(x, ids, w)
        assert torch.equal(got, group.forward(x, ids, w, team=False))
        moe.state.group = None
        want = moe(x, ids, w)
        moe.state.group = group
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert sqnr_db(naive_moe(experts, x, ids, w), got) >= (40 if activation is None else 25)


def test_no_native_group_where_gate_and_up_are_not_stacked():
    moe = build(make_experts(E, H, I, FORMATS["w4-actorder-g32"], seed=11), 2, "grouped")
    assert moe.state.experts[0].gate_up is None and moe.state.group is None


def test_native_expert_group_bad_inputs_are_named():
    moe = build(make_experts(4, H, I, FORMATS["w4-sym-g32"], seed=14), 2, "grouped")
    group = moe.state.group
    x = _x(1)
    with pytest.raises(KernelError, match=r"expert group: ids\[0, 1\] = 4; the group has 4"):
        group.forward(x, torch.tensor([[0, 4]]), torch.ones(1, 2))
    with pytest.raises(KernelError, match=r"'x' should be contiguous float32 \[T, 128\], T >= 1"):
        group.forward(_x(2)[:, :64], torch.tensor([[0, 1]]), torch.ones(1, 2))
    with pytest.raises(KernelError, match=r"'ids' should be contiguous int64 \[2, k\]"):
        group.forward(_x(2), torch.tensor([[0, 1]]), torch.ones(1, 2))
    with pytest.raises(KernelError, match=r"'weights' should be contiguous float32 \[1, 2\]"):
        group.forward(x, torch.tensor([[0, 1]]), torch.ones(1, 3))
    with pytest.raises(KernelError, match=r"'ids' should be contiguous int64 \[1, k\]"):
        group.forward(x, torch.tensor([[0, 1]], dtype=torch.int32), torch.ones(1, 2))
    lin = moe.state.experts[0]
    with pytest.raises(KernelError, match=r"expert group: expert 0: gate_up is \[128, 128\], expected \[256, 64\]"):
        type(group)(64, 128).add_expert(lin.gate_up.state.handle, lin.down.state.handle)


def test_native_expert_group_keeps_its_linears_alive():
    """The group borrows the C++ linears; dropping the Python experts must not free them under it."""
    import gc
    moe = build(make_experts(4, H, I, FORMATS["w4-sym-g32"], seed=15), 2, "grouped")
    x, ids, w = _x(1), torch.tensor([[1, 3]]), torch.tensor([[0.25, 0.75]])
    want = moe(x, ids, w)
    moe.state.experts.clear()
    gc.collect()
    torch.testing.assert_close(moe(x, ids, w), want, rtol=0, atol=0)
