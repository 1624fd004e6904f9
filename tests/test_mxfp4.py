"""MXFP4 (FP4 E2M1 codes, an E8M0 scale per 32 weights): the canonical weight and its native kernels.

Bit-exact against the tools' own dequantization: gguf-py's ``MXFP4.dequantize`` on a file
llama.cpp's quantizer wrote (``MXFP4_MOE``: experts MXFP4, everything else Q8_0), and
transformers' ``integrations.mxfp4`` on HF ``*_blocks`` / ``*_scales`` pairs written here.
The native kernels (float and int8-group activations) against the dequantize-to-float32
reference, every ISA variant equal to the scalar twin bit for bit, and a whole MoE model
through them (the expert group's team calls).
"""

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from safetensors.torch import save_file

from quill import native
from quill.canonical import E8M0, FP4_E2M1, ActivationQuant, QuantizedWeight
from quill.engine.loader import build_model
from quill.errors import CheckpointError
from quill.formats.checkpoint import open_checkpoint
from quill.formats.gguf.checkpoint import GGUFCheckpoint
from quill.formats.mxfp4 import mxfp4_weight
from quill.kernels import KernelPolicy, KernelSelector, build_quant_linear
from quill.kernels.activation import fake_quantize_activations
from quill.kernels.mxfp4 import make_handle
from quill.layers import SparseMoeBlock
from quill.models.base import ForwardContext
from quill.native.mxfp4_pack import pack_mxfp4
from quill.platform import detect
from tests.gguf_util import T
from tests.llamacpp_util import quantize
from tests.moe_models_util import fuse_experts, hf_moe_model
from tests.test_moe_gguf import ALL_SPARSE, to_gguf
from tests.test_moe_models import TOL, hf_logits, ids_of, load, selectors

PLATFORM = detect()
ISAS = ["scalar"] + [name for name, flags in native.ISAS if PLATFORM.has(*flags)]
GROUP_ACT = ActivationQuant(bits=8, dynamic=True, symmetric=True, per_group=True)


@pytest.fixture(scope="module")
def mx_gguf(tmp_path_factory):
    """A tiny qwen3_moe GGUF through llama.cpp's quantizer (MXFP4_MOE), and the float model."""
    d = tmp_path_factory.mktemp("mxfp4")
    hf = hf_moe_model("qwen3_moe", seed=3, **ALL_SPARSE["qwen3_moe"])
    src, _ = to_gguf(hf, "qwen3_moe", d / "f32.gguf", every_type=T.F32)
    return quantize(src, d / "mxfp4.gguf", "MXFP4_MOE"), hf


def test_gguf_mxfp4_bit_exact_with_gguf_py(mx_gguf):
    ckpt = GGUFCheckpoint(mx_gguf[0])
    assert set(ckpt.tensor_types) == {"F32", "Q8_0", "MXFP4"}  # MXFP4_MOE: only the experts are MXFP4
    seen = 0
    for module, (src, _) in ckpt._quantized.items():
        info = ckpt.file.info(src.gguf)
        if info.type_name != "MXFP4":
            continue
        qw = ckpt.read_layer(module)
        assert (qw.bits, qw.group_size, qw.scales.dtype) == (4, 32, E8M0)
        ref = gguf_dequantize(ckpt.file.raw(src.gguf).numpy(), GGMLQuantizationType.MXFP4)
        ref = torch.from_numpy(np.ascontiguousarray(ref)).reshape(-1, qw.out_features, qw.in_features)[src.expert]
        assert torch.equal(qw.dequantize(), ref), module
        assert torch.equal(qw.uniform().dequantize(), ref), module  # what codebook-blind kernels get
        assert qw.storage_bytes() * 8 == qw.out_features * qw.in_features * 4.25  # as stored: 17 bytes / 32
        seen += 1
    assert seen == mx_gguf[1].config.num_hidden_layers * 8 * 3  # layers x experts x projections


def test_gguf_mxfp4_model_matches_transformers_on_its_weights(mx_gguf):
    path, hf = mx_gguf
    ckpt = open_checkpoint(path)
    state = {f"{m}.weight": qw.dequantize() for m, qw in ckpt.quantized_layers()}
    state.update({k: v.float() for k, v in ckpt.dense_tensors()})
    missing, unexpected = hf.load_state_dict(fuse_experts(state), strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    ids = ids_of(7, seed=4)
    for kernel in ("reference", None):  # None: the platform's own choice (native on AVX2)
        loaded = load(open_checkpoint(path), kernel, "grouped")
        if kernel is None:
            _assert_native_experts(loaded, "native_mxfp4a16")
        torch.testing.assert_close(loaded.model(ids, ForwardContext.causal(1, 7)), hf_logits(hf, ids), **TOL)


def _assert_native_experts(loaded, kernel: str) -> None:
    """Every expert projection on ``kernel``, all in one native ExpertGroup (its team calls)."""
    for block in [m for m in loaded.model.modules() if isinstance(m, SparseMoeBlock)]:
        state = block.fused.state
        assert {lin.kernel_name for ex in state.experts for lin in (ex.gate_up, ex.down)} == {kernel}
        assert state.group is not None


def _hf_pair(experts: int, out: int, inp: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random blocks [E, out, in / 32, 16] and exponents [E, out, in / 32]: every code, exponents 0..254."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (experts, out, inp // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (experts, out, inp // 32), dtype=torch.uint8, generator=g)
    scales.view(-1)[:3] = torch.tensor([0, 1, 254], dtype=torch.uint8)  # subnormal and largest scales
    return blocks, scales


def convert_moe_packed_tensors(*args, **kwargs):
    """transformers' own MXFP4 decoding, imported here: its module takes seconds to import."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors as convert
    return convert(*args, **kwargs)


def test_hf_blocks_scales_bit_exact_with_transformers():
    blocks, scales = _hf_pair(3, 8, 64, seed=5)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [E, in, out]: x @ W
    for e in range(3):
        qw = mxfp4_weight(blocks[e], scales[e], name=f"experts.{e}").validate()
        assert torch.equal(qw.dequantize(), ref[e].T), e
        assert torch.equal(qw.uniform().dequantize(), ref[e].T), e
        assert qw.uniform().bits == 5  # E2M1 x 2 in [-12, 12]


def test_hf_checkpoint_reader(tmp_path):
    gu_b, gu_s = _hf_pair(2, 16, 64, seed=6)
    dn_b, dn_s = _hf_pair(2, 64, 32, seed=7)
    p = "model.layers.0.mlp.experts"
    tensors = {f"{p}.gate_up_proj_blocks": gu_b, f"{p}.gate_up_proj_scales": gu_s,
               f"{p}.gate_up_proj_bias": torch.randn(2, 16), f"{p}.down_proj_blocks": dn_b,
               f"{p}.down_proj_scales": dn_s, "model.layers.0.mlp.router.weight": torch.randn(2, 64)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    cfg = {"model_type": "gpt_oss", "quantization_config": {"quant_method": "mxfp4",
                                                            "modules_to_not_convert": ["model.layers.*.self_attn"]}}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    ckpt = open_checkpoint(tmp_path)
    assert ckpt.quant_method == "mxfp4"
    layers = dict(ckpt.quantized_layers())
    assert sorted(layers) == [f"{p}.down_proj", f"{p}.gate_up_proj"]
    gu = layers[f"{p}.gate_up_proj"]
    ref = convert_moe_packed_tensors(gu_b, gu_s, dtype=torch.float32)  # [E, in, out]
    assert (gu.out_features, gu.in_features) == (2 * 16, 64)  # experts' rows stacked
    assert torch.equal(gu.dequantize(), torch.cat([ref[0].T, ref[1].T]))
    assert torch.equal(gu.bias, tensors[f"{p}.gate_up_proj_bias"].reshape(-1))
    assert layers[f"{p}.down_proj"].bias is None
    assert [n for n, _ in ckpt.dense_tensors()] == ["model.layers.0.mlp.router.weight"]


def test_hf_checkpoint_blocks_without_scales_is_refused(tmp_path):
    blocks, _ = _hf_pair(1, 4, 32, seed=8)
    save_file({"m.experts.down_proj_blocks": blocks}, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "mxfp4"}}))
    with pytest.raises(CheckpointError, match=r"'m.experts.down_proj_blocks' has no 'm.experts.down_proj_scales'"):
        open_checkpoint(tmp_path)


def test_nan_exponent_and_bad_codebook_are_refused():
    blocks, scales = _hf_pair(1, 4, 32, seed=9)
    scales[0, 2, 0] = 255
    with pytest.raises(CheckpointError, match="exponent 255"):
        mxfp4_weight(blocks[0], scales[0], name="l").validate()
    qw = mxfp4_weight(blocks[0], scales[0].clamp(max=200), name="l")
    with pytest.raises(CheckpointError, match=r"'codebook' should be float32 \[16\]"):
        qw.with_(codebook=FP4_E2M1[:8]).validate()
    with pytest.raises(Exception, match="codebook codes with zeros"):
        QuantizedWeight.validate(qw.with_(zeros=torch.zeros(4, 1, dtype=torch.int16)))


# ---- native kernels ------------------------------------------------------------------------

def _weight(n: int, k: int, seed: int) -> QuantizedWeight:
    blocks, scales = _hf_pair(1, n, k, seed)
    return mxfp4_weight(blocks[0], (scales[0] - 100) // 4 + 117, bias=torch.randn(n), name="w").validate()


@pytest.mark.parametrize("m", [1, 3, 9])  # one token, a partial tile, tiles of 4 and a rest
@pytest.mark.parametrize("int8", [False, True])
def test_native_kernel_matches_reference_and_scalar_twin(m, int8):
    w = _weight(40, 96, seed=10 + m)  # 40 rows: a partial row block
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(m))
    groups = torch.arange(96) // 32
    xr = fake_quantize_activations(x, GROUP_ACT, groups) if int8 else x
    ref = (xr.double() @ w.dequantize().double().T + w.bias.double()).float()
    packed = pack_mxfp4(w)
    outs = {isa: make_handle(packed, "w", isa, 2, int8).forward(x, w.bias) for isa in ISAS}
    for isa, y in outs.items():
        assert torch.equal(y, outs["scalar"]), isa
    torch.testing.assert_close(outs["scalar"], ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    y16 = make_handle(packed, "w", ISAS[-1], 1, int8).forward(x.bfloat16())
    assert y16.dtype == torch.bfloat16 and y16.shape == (m, 40)


def test_selection_stored_bits_and_fallbacks():
    w = _weight(48, 64, seed=20)
    lin, _ = selectors(None)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(21))
    ref = x @ w.dequantize().T + w.bias
    for act, kernel in ((None, "native_mxfp4a16"), ("int8-group", "native_mxfp4a8"), ("int8", "native_w6a8")):
        ql = build_quant_linear(w, lin, act)
        assert ql.kernel_name == kernel, act
        tol = 1e-5 if act is None else 0.05
        torch.testing.assert_close(ql(x), ref, rtol=tol, atol=tol * float(ref.abs().max()))
    ql = build_quant_linear(w, lin)
    assert ql.selection.kernel.state_bytes(ql.state) * 8 == 48 * 64 * 4.25  # the stored bits, no more
    assert ql.weight_bytes == w.storage_bytes()
    refused = KernelSelector(PLATFORM, KernelPolicy(force="native_mxfp4a16"))
    q4 = QuantizedWeight(codes=torch.zeros(16, 32, dtype=torch.uint8), bits=4, group_size=32,
                         scales=torch.ones(16, 1), name="q4")
    with pytest.raises(Exception, match="runs FP4 E2M1 codes with E8M0 scales"):
        build_quant_linear(q4, refused)


def test_mxfp4_moe_model_on_native_kernels_int8_group(mx_gguf):
    path, hf = mx_gguf
    lin, moe = selectors(None, "grouped")
    loaded = build_model(open_checkpoint(path), lin, activation="int8-group", moe_selector=moe)
    _assert_native_experts(loaded, "native_mxfp4a8")
    ref_lin, _ = selectors("reference")  # the oracle quantizes activations the same way (per 32 columns)
    oracle = build_model(open_checkpoint(path), ref_lin, activation="int8-group", moe_selector=moe)
    ids = ids_of(7, seed=4)
    ref = torch.log_softmax(oracle.model(ids, ForwardContext.causal(1, 7)), -1)
    got = torch.log_softmax(loaded.model(ids, ForwardContext.causal(1, 7)), -1)
    # The oracle's float matmuls round with torch's thread count (one thread under taskset): one ulp in a
    # hidden state can move one activation across an int8 rounding boundary, a one-step change measured at
    # 3.6e-3 on one position.  A wrong code, scale or group moves every position far beyond that.
    err = (got - ref).abs().amax(-1)[0]  # [7]: per position
    assert int((err > 1e-3).sum()) <= 1 and float(err.max()) < 2e-2, err


def test_pack_layout_four_columns_per_lane():
    """codes [NB, G, 4 jj, 16 r, 4 b]: byte = q[16 nb + r][32 g + 4 jj + b] | q[..][.. + 16] << 4 (mxfp4.h)."""
    w = _weight(20, 64, seed=30)  # 20 rows: the second row block padded with zero codes
    p = pack_mxfp4(w)
    assert p.codes.shape == (2, 2, 4, 16, 4) and p.scales.shape == (2, 2, 16)
    q = torch.cat([w.codes, w.codes.new_zeros(12, 64)])
    for nb, g, jj, r, b in ((0, 0, 0, 0, 0), (0, 1, 3, 15, 3), (1, 0, 2, 3, 1), (1, 1, 1, 7, 2)):
        col = 32 * g + 4 * jj + b
        assert int(p.codes[nb, g, jj, r, b]) == int(q[16 * nb + r, col]) | int(q[16 * nb + r, col + 16]) << 4
    assert not p.codes[1, :, :, 4:].any()  # rows 20..31: zero codes


@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6])  # every tile width, alone and after a full tile
@pytest.mark.parametrize("int8", [False, True])
@pytest.mark.parametrize("n,bias", [(17, True), (16, False)])
def test_native_kernel_one_group_every_tile(m, int8, n, bias):
    w = _weight(n, 32, seed=40 + m)  # K = 32: one group
    b = w.bias if bias else None
    x = torch.randn(m, 32, generator=torch.Generator().manual_seed(50 + m))
    xr = fake_quantize_activations(x, GROUP_ACT, torch.zeros(32, dtype=torch.long)) if int8 else x
    ref = (xr.double() @ w.dequantize().double().T + (b.double() if bias else 0)).float()
    packed = pack_mxfp4(w)
    outs = {isa: make_handle(packed, "w", isa, 1, int8).forward(x, b) for isa in ISAS}
    for isa, y in outs.items():
        assert torch.equal(y, outs["scalar"]), isa
    torch.testing.assert_close(outs["scalar"], ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@pytest.mark.parametrize("code", [7, 15])  # kv +12 / -12: the SIMD codes' bias at 24 and 0
def test_native_int8_sums_at_their_extremes(code):
    """Every activation at -128 or 127 (x = -1 / +1 per group) against |kv| = 12: the largest int16
    partial sums of the AVX2 kernel (8 products: 24 x 128 x 8) and the int32 bias term, exact."""
    blocks = torch.full((16, 64, 16), code * 17, dtype=torch.uint8)  # 16 rows, K = 2048: the code in both nibbles
    w = mxfp4_weight(blocks, torch.full((16, 64), 127, dtype=torch.uint8), name="w").validate()
    x = torch.tensor([[-1.0] * 2048, [1.0] * 2048, [-1.0, 1.0] * 1024])
    ref = fake_quantize_activations(x, GROUP_ACT, torch.arange(2048) // 32).double() @ w.dequantize().double().T
    packed = pack_mxfp4(w)
    outs = {isa: make_handle(packed, "w", isa, 1, True).forward(x) for isa in ISAS}
    for isa, y in outs.items():
        assert torch.equal(y, outs["scalar"]), isa
    torch.testing.assert_close(outs["scalar"], ref.float(), rtol=1e-6, atol=0)
