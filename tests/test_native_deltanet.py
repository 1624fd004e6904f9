"""The native Gated DeltaNet decode update (csrc/deltanet*, ``deltanet_decode``): every ISA variant this
CPU runs against a float64 torch reference written from transformers' recurrent rule, over many steps
of several sequences sharing the state pools, and bit for bit against the scalar twin; and a tiny Qwen3.5 model's
decode tokens through the engine, which run it (quill.layers.deltanet), against its torch form."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import quill
from quill import native
from quill.engine.core import EngineConfig, EngineCore
from quill.errors import KernelError
from quill.platform import detect
from tests.model_util import save_hf_dir

EXT = native.load().module
PLATFORM = detect()
ISAS = ["scalar"] + [name for name, flags in reversed(native.ISAS) if PLATFORM.has(*flags)]
BEST = native.isa_for(PLATFORM) or "scalar"  # what a model loaded here hands the op
STEPS = 64
# (key heads, value heads, dk, dv, conv kernel, conv bias): odd head dims; conv channels
# 2 Hk dk + Hv dv = 176, 161 and 416; dv 20 / 37 / 72 run the 4-vector blocks, single vectors and
# single columns of the state passes
CASES = [(2, 4, 24, 20, 4, False), (1, 3, 25, 37, 3, True), (2, 4, 32, 72, 4, False)]
POOL_ROWS = 5
ROWS = [4, 0, 2]  # the batch's sequences own these rows of the pools; rows 1 and 3 are not theirs


def _layer(hk, hv, dk, dv, kk, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    c = 2 * hk * dk + hv * dv
    return {
        "conv_w": torch.randn(c, kk, generator=g) * 0.5,
        "conv_b": torch.randn(c, generator=g) * 0.1 if bias else None,
        "A_log": torch.log(torch.empty(hv).uniform_(0.5, 16, generator=g)),  # transformers' init range
        "dt_bias": torch.randn(hv, generator=g) * 0.5,
        "norm_w": 1 + 0.1 * torch.randn(dv, generator=g),
        "eps": 1e-6,
    }


def _pools(hk, hv, dk, dv, kk, seed=1):
    g = torch.Generator().manual_seed(seed)
    c = 2 * hk * dk + hv * dv
    return torch.randn(POOL_ROWS, c, kk - 1, generator=g), 0.1 * torch.randn(POOL_ROWS, hv, dk, dv, generator=g)


def _inputs(b, hk, hv, dk, dv, g):
    c = 2 * hk * dk + hv * dv
    a = torch.randn(b, hv, generator=g) * 2
    a[0, 0] = 30.0  # past softplus's threshold (20): softplus(x) = x, the state decays to 0
    return torch.randn(b, c, generator=g), torch.randn(b, hv * dv, generator=g), a, torch.randn(b, hv, generator=g) * 2


def reference_step(qkv, z, a, b, layer, conv_state, state, hk, tiled=False):
    """transformers' decode (causal_conv1d_update, torch_recurrent_gated_delta_rule with the q/k
    l2norm, Qwen3_5RMSNormGated) in float64 on the rows of one batch: states updated in place.
    tiled: value head h reads key head h % Hk (llama.cpp's order of the value heads)."""
    w, hv, dk, dv = layer["conv_w"].double(), state.shape[1], state.shape[2], state.shape[3]
    window = torch.cat([conv_state, qkv[:, :, None]], dim=-1)  # [B, C, K]
    conv_state.copy_(window[:, :, 1:])
    x = (window * w).sum(-1)
    if layer["conv_b"] is not None:
        x = x + layer["conv_b"].double()
    x = F.silu(x)
    q, k, v = torch.split(x, [hk * dk, hk * dk, hv * dv], dim=-1)
    # value head h reads key head h // (Hv / Hk), or h % Hk tiled
    q, k = (t.view(-1, hk, dk).repeat(1, hv // hk, 1) if tiled else t.view(-1, hk, dk).repeat_interleave(hv // hk, 1)
            for t in (q, k))
    v = v.reshape(-1, hv, dv)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) / math.sqrt(dk)
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    g = -layer["A_log"].double().exp() * F.softplus(a + layer["dt_bias"].double())
    beta = b.sigmoid()
    state.mul_(g.exp()[..., None, None])
    kv_mem = (state * k[..., None]).sum(-2)
    delta = (v - kv_mem) * beta[..., None]
    state.add_(k[..., None] * delta[..., None, :])
    o = (state * q[..., None]).sum(-2)  # [B, Hv, dv]
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + layer["eps"])
    return (layer["norm_w"].double() * o * F.silu(z.view(-1, hv, dv))).reshape(len(z), -1)


def _run(layer, qkv, z, a, b, conv_state, state, rows, isa, tiled=False):
    return EXT.deltanet_decode(qkv, z, a, b, layer["conv_w"], layer["conv_b"], layer["A_log"], layer["dt_bias"],
                               layer["norm_w"], layer["eps"], conv_state, state, rows, isa, tiled)


def _rel(got, want):
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("tiled", [False, True], ids=["hf-heads", "gguf-heads"])
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "hk{}-hv{}-dk{}-dv{}-K{}-bias{}".format(*c))
def test_matches_float64_reference_over_many_steps(case, isa, tiled):
    hk, hv, dk, dv, kk, bias = case
    layer = _layer(*case)
    conv_state, state = _pools(hk, hv, dk, dv, kk)
    ref_conv, ref_state = conv_state.double(), state.double()
    rows = torch.tensor(ROWS)
    g = torch.Generator().manual_seed(2)
    worst = 0.0
    for _ in range(STEPS):
        qkv, z, a, b = _inputs(len(ROWS), hk, hv, dk, dv, g)
        out = _run(layer, qkv, z, a, b, conv_state, state, rows, isa, tiled)
        rc, rs = ref_conv[rows], ref_state[rows]
        want = reference_step(qkv.double(), z.double(), a.double(), b.double(), layer, rc, rs, hk, tiled)
        ref_conv[rows], ref_state[rows] = rc, rs
        assert out.shape == (len(ROWS), hv * dv) and out.dtype == torch.float32
        worst = max(worst, _rel(out, want))
    assert worst <= 1e-5, worst
    assert _rel(state, ref_state) <= 1e-5 and _rel(conv_state, ref_conv) <= 1e-6
    others = [1, 3]  # rows no sequence of the batch owns are never touched
    assert torch.equal(state[others], _pools(hk, hv, dk, dv, kk)[1][others])


@pytest.mark.parametrize("tiled", [False, True], ids=["hf-heads", "gguf-heads"])
@pytest.mark.parametrize("case", CASES[:2], ids=["dv20", "dv37"])
def test_isa_variants_are_the_scalar_twin_bit_for_bit(case, tiled):
    hk, hv, dk, dv, kk, bias = case
    layer = _layer(*case, seed=3)
    rows = torch.tensor(ROWS)
    pools = {isa: _pools(hk, hv, dk, dv, kk, seed=4) for isa in ISAS}
    g = torch.Generator().manual_seed(5)
    for _ in range(16):
        inputs = _inputs(len(ROWS), hk, hv, dk, dv, g)
        want = _run(layer, *inputs, *pools["scalar"], rows, "scalar", tiled)
        for isa in ISAS[1:]:
            assert torch.equal(_run(layer, *inputs, *pools[isa], rows, isa, tiled), want), isa
    for isa in ISAS[1:]:
        assert all(torch.equal(p, s) for p, s in zip(pools[isa], pools["scalar"])), isa


def test_reference_is_transformers_decode():
    """The float64 reference above against transformers' own functions (float32), a few steps."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf

    hk, hv, dk, dv, kk, _ = CASES[0]
    layer = _layer(*CASES[0])
    conv_state, state = _pools(hk, hv, dk, dv, kk)
    ref_conv, ref_state = conv_state.double(), state.double()
    norm = hf.Qwen3_5RMSNormGated(dv, eps=layer["eps"])
    norm.weight.data.copy_(layer["norm_w"])
    g = torch.Generator().manual_seed(6)
    for _ in range(4):
        qkv, z, a, b = _inputs(len(conv_state), hk, hv, dk, dv, g)
        want = reference_step(qkv.double(), z.double(), a.double(), b.double(), layer, ref_conv, ref_state, hk)
        x = hf.causal_conv1d_update(qkv[:, :, None], conv_state, layer["conv_w"], None, "silu")[:, :, 0]
        q, k, v = torch.split(x, [hk * dk, hk * dk, hv * dv], dim=-1)
        decay = -layer["A_log"].exp() * F.softplus(a + layer["dt_bias"])
        o, state = hf.torch_recurrent_gated_delta_rule(
            q.view(-1, 1, hk, dk), k.view(-1, 1, hk, dk), v.view(-1, 1, hv, dv), g=decay[:, None],
            beta=b.sigmoid()[:, None], initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
        got = norm(o.reshape(-1, dv), z.reshape(-1, dv)).reshape(len(z), -1)
        assert _rel(got, want) < 1e-5
    assert _rel(state, ref_state) < 1e-5 and _rel(conv_state, ref_conv) < 1e-6


def test_bad_input_is_a_named_error():
    hk, hv, dk, dv, kk, bias = CASES[0]
    layer = _layer(*CASES[0])
    conv_state, state = _pools(hk, hv, dk, dv, kk)
    inputs = _inputs(3, hk, hv, dk, dv, torch.Generator().manual_seed(7))
    rows = torch.tensor(ROWS)
    with pytest.raises(KernelError, match=r"deltanet_decode: 'conv_state' should be contiguous float32 \[5, 176, 3\]"):
        _run(layer, *inputs, conv_state[:, :, :2].contiguous(), state, rows, "scalar")
    with pytest.raises(KernelError, match=r"'conv_w' has 175 channels; with 'state' \[N, 4, 24, 20\] expected"):
        _run(dict(layer, conv_w=layer["conv_w"][:175]), *inputs, conv_state, state, rows, "scalar")
    with pytest.raises(KernelError, match=r"'A_log' should be contiguous float32 \[4\], found c10::Half"):
        _run(dict(layer, A_log=layer["A_log"].half()), *inputs, conv_state, state, rows, "scalar")
    with pytest.raises(KernelError, match=r"'z' should be float32 \[3, 80\], found float \[3, 79\]"):
        _run(layer, inputs[0], inputs[1][:, :79], *inputs[2:], conv_state, state, rows, "scalar")
    with pytest.raises(KernelError, match="sequence 1 names state row 5; the pools have 5"):
        _run(layer, *inputs, conv_state, state, torch.tensor([4, 5, 2]), "scalar")
    with pytest.raises(KernelError, match="two sequences name state row 2"):
        _run(layer, *inputs, conv_state, state, torch.tensor([2, 0, 2]), "scalar")
    with pytest.raises(KernelError, match="deltanet_decode: unknown ISA 'sse9'"):
        _run(layer, *inputs, conv_state, state, rows, "sse9")


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """A tiny random qwen3_5_text (3 Gated DeltaNet layers + 1 attention layer) loaded by quill, float32."""
    import transformers as t

    cfg = t.Qwen3_5TextConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=24, linear_key_head_dim=20,
                              linear_value_head_dim=24, linear_num_key_heads=2, linear_num_value_heads=4,
                              max_position_embeddings=256, tie_word_embeddings=False, bos_token_id=1,
                              eos_token_id=2, pad_token_id=3)
    torch.manual_seed(0)
    hf = t.Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():  # A_log, dt_bias and the norms away from their init
        for name, p in hf.named_parameters():
            if name.endswith("A_log"):
                p.uniform_(-1.0, 1.5)
            elif name.endswith("dt_bias") or p.dim() >= 2:
                p.normal_(0, 1 if name.endswith("dt_bias") else 0.08)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    d = save_hf_dir(hf, tmp_path_factory.mktemp("qwen3_5") / "ckpt", tokenizer=False)
    return quill.LLM(str(d), kernel="reference", skip_tokenizer_init=True, kv_cache_dtype="float32")


def _generate(llm, prompts: dict[str, list[int]], n: int) -> dict[str, tuple[list[int], list[float]]]:
    """request id -> (greedy tokens, their log-probabilities), the prompts batched in one engine."""
    core = EngineCore(llm.model, llm.eos_token_ids, llm.context_length, EngineConfig(kv_cache_dtype="float32"))
    for rid, p in prompts.items():
        core.add_request(rid, p, quill.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=1))
    out: dict = {rid: ([], []) for rid in prompts}
    while core.has_unfinished_requests():
        for o in core.step():
            for tok, lps in zip(o.new_token_ids, o.logprobs, strict=True):  # one dict per new token
                out[o.request_id][0].append(tok)
                out[o.request_id][1].append(lps[tok].logprob)
    return out


def test_model_decode_runs_the_native_update(hybrid):
    """The engine's decode tokens go through deltanet_decode (the ISA chosen at load); tokens and
    log-probabilities are those of the layer's torch form (quill.layers.deltanet, isa None)."""
    layers = [layer.linear_attn for layer in hybrid.model.model.layers if layer.recurrent]
    assert len(layers) == 3 and all(layer.isa == BEST for layer in layers)
    g = torch.Generator().manual_seed(8)
    prompts = {rid: torch.randint(4, 256, (n,), generator=g).tolist() for rid, n in (("a", 20), ("b", 7))}
    got = _generate(hybrid, prompts, 16)
    try:
        for layer in layers:
            layer.isa = None
        want = _generate(hybrid, prompts, 16)
    finally:
        for layer in layers:
            layer.isa = BEST
    for rid in prompts:
        assert got[rid][0] == want[rid][0], rid
        assert max(abs(x - y) for x, y in zip(got[rid][1], want[rid][1])) < 1e-4, rid
