"""Native kernels (quill/native): every ISA variant this CPU runs against its scalar twin and `reference`.

Every kernel and both activation encoders must equal their scalar twins bit for
bit: the int32 dot products are exact and the float epilogue is the same per lane.
Float activations (W4A16, W8A16) enter as a 24-bit (exact mode) or 16-bit fixed-point
image per segment, checked against an independent torch implementation of its definition
(test_native_activations.py); against `reference` (float32) they reach 75+ dB.  int8 activations (W4A8, W8A8)
are compared with a reference that quantizes activations identically
(quill/kernels/activation.py).
"""

from __future__ import annotations

import pytest
import torch

from quill import native
from quill.bench.stats import sqnr
from quill.canonical import ActivationQuant
from quill.errors import KernelError
from quill.kernels.activation import fake_quantize_activations
from quill.kernels.native import make_handle
from quill.native.pack import pack, stream_order
from quill.platform import detect
from quill.writers.rtn import quantize_rtn

PLATFORM = detect()
EXT = native.load()


def _variants() -> list[str]:
    """ISA variants this CPU can execute, the scalar twin first."""
    return ["scalar"] + [name for name, flags in native.ISAS if PLATFORM.has(*flags)]


INT8_VARIANTS = FLOAT_VARIANTS = _variants()
IMAGES = (24, 16)  # the float activations' fixed-point images: the exact mode and the default




def _weight(n, k, bits=4, gs=32, sym=True, act_order=False, offsets=False, scale_dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.05
    qw = quantize_rtn(w, bits, gs, sym, act_order, offsets, generator=g, scale_dtype=scale_dtype)
    qw = qw.with_(name="layers.0.mlp.down_proj")
    return qw


def _run(qw, x, isa, int8, threads=2, bias=None, image_bits=24):
    handle = make_handle(pack(qw, int8), qw.name, qw.activation, isa, threads, int8, image_bits)
    return handle.forward(x, bias)


def test_extension_is_built():
    assert EXT.error is None, EXT.error
    # without OpenMP in the binding, at::parallel_for silently runs on one thread
    assert EXT.module.parallel_backend_compiled()
    assert "avx2" in INT8_VARIANTS or not PLATFORM.has("avx2", "fma", "f16c")


# (bits, group, symmetric, act_order, offsets, scale dtype, N, K): odd shapes, every weight variant
WEIGHTS = [
    (4, 32, True, False, False, torch.float16, 37, 256),   # GPTQ/CT sym g32, N not a multiple of 16
    (4, 128, False, False, False, torch.bfloat16, 16, 384),  # AWQ-like asym g128, bf16 scales
    (4, 64, True, True, False, torch.float16, 33, 256),    # GPTQ act-order
    (4, 32, False, False, True, torch.float16, 20, 96),    # GGUF Q4_1 (float offsets)
    (4, -1, True, False, False, torch.float32, 5, 203),    # per-channel, odd K, fp32 scales
    (4, 12, False, False, False, torch.float16, 17, 36),   # group not a multiple of the chunk
    (8, -1, True, False, False, torch.bfloat16, 40, 200),  # CT W8A8 / W8A16 per-channel
    (8, 32, True, False, False, torch.float16, 19, 128),   # GGUF Q8_0
    (8, 128, False, True, False, torch.float16, 18, 256),  # GPTQ 8-bit asym act-order
    (5, 32, True, False, False, torch.float16, 21, 128),   # GGUF Q5_0 (4-bit nibbles + 1-bit plane)
    (5, 32, False, False, True, torch.float16, 16, 96),    # GGUF Q5_1
    (6, 16, True, True, False, torch.float16, 35, 160),    # 6-bit (2-bit plane) with act-order
    (6, -1, False, False, False, torch.bfloat16, 7, 203),  # 6-bit asym per-channel, odd K
    (3, 32, True, False, False, torch.float16, 37, 256),   # 3-bit (2-bit pairs + third-bit plane)
    (3, 64, False, True, False, torch.bfloat16, 18, 256),  # 3-bit asym act-order
    (2, 16, False, False, True, torch.float16, 21, 160),   # 2-bit with float offsets
    (2, -1, True, False, False, torch.float32, 5, 203),    # 2-bit per-channel, odd K
]
WEIGHT_IDS = [f"w{b}-g{g}-{'sym' if s else 'asym'}{'-ao' if a else ''}{'-off' if o else ''}-{n}x{k}"
              for b, g, s, a, o, _, n, k in WEIGHTS]


@pytest.mark.parametrize("spec", WEIGHTS, ids=WEIGHT_IDS)
def test_dequantize_rows_is_take_rows_then_dequantize(spec):  # the embedding lookup
    bits, gs, sym, ao, off, sdt, n, k = spec
    qw = _weight(n, k, bits, gs, sym, ao, off, sdt)
    ids = torch.tensor([n - 1, 0, n // 2, 0])
    assert torch.equal(qw.dequantize_rows(ids), qw.take_rows(ids).dequantize())


@pytest.mark.parametrize("spec", WEIGHTS, ids=WEIGHT_IDS)
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("image", IMAGES)
def test_float_kernels_bit_exact_and_match_reference(spec, xdtype, image):
    bits, gs, sym, ao, off, sdt, n, k = spec
    qw = _weight(n, k, bits, gs, sym, ao, off, sdt)
    x = torch.randn(5, k, generator=torch.Generator().manual_seed(1)).to(xdtype)
    ref = x.float() @ qw.dequantize().T  # float32 reference, float32 activations
    outs = {isa: _run(qw, x, isa, int8=False, image_bits=image) for isa in FLOAT_VARIANTS}
    for isa, y in outs.items():
        assert y.dtype == xdtype and y.shape == (5, n)
        assert torch.equal(y, outs["scalar"]), f"{isa} differs from its scalar twin"
    # float32 results: the fixed-point image's error alone (16-bit: 2^-16 of each segment's max, ~90 dB;
    # 24-bit: float32's own rounding); 16-bit results: their own rounding dominates (bf16 ~55 dB, fp16 ~70 dB)
    limit = {torch.float32: 75, torch.bfloat16: 45, torch.float16: 60}[xdtype]
    assert sqnr(outs["scalar"].float(), ref) >= limit, sqnr(outs["scalar"].float(), ref)
    if image == 24 and xdtype == torch.float32:  # the exact mode tracks float32 well past the 16-bit image
        assert sqnr(outs["scalar"], ref) >= 110, sqnr(outs["scalar"], ref)


@pytest.mark.parametrize("spec", WEIGHTS, ids=WEIGHT_IDS)
@pytest.mark.parametrize("act", ["dyn-sym", "dyn-asym", "static-sym", "static-asym", "dyn-group"])
def test_int8_kernels_bit_exact_and_match_reference(spec, act):
    bits, gs, sym, ao, off, sdt, n, k = spec
    aq = {"dyn-sym": ActivationQuant(), "dyn-asym": ActivationQuant(symmetric=False),
          "dyn-group": ActivationQuant(per_group=True),
          "static-sym": ActivationQuant(dynamic=False, scale=0.021),
          "static-asym": ActivationQuant(dynamic=False, symmetric=False, scale=0.017, zero_point=-5)}[act]
    qw = _weight(n, k, bits, gs, sym, ao, off, sdt).with_(activation=aq)
    x = torch.randn(6, k, generator=torch.Generator().manual_seed(2))
    outs = {isa: _run(qw, x, isa, int8=True) for isa in INT8_VARIANTS}
    for isa, y in outs.items():
        assert torch.equal(y, outs["scalar"]), f"{isa} differs from its scalar twin"
    emulated = fake_quantize_activations(x, aq, qw.group_index()) @ qw.dequantize().T
    assert sqnr(outs["scalar"], emulated) >= 40, sqnr(outs["scalar"], emulated)
    # against float activations the int8 rounding dominates; report-level sanity only
    if aq.dynamic:
        assert sqnr(outs["scalar"], x @ qw.dequantize().T) >= 25


# GGUF types from random blocks (tests/gguf_util.py): K-quants have two-level scales, read as stored
# (int8 per group x f16 per super-block) and bit for bit what the flattened float32 scales give.
# Stored bits per weight: Q2_K 2.625, Q3_K 3.4375 (2-bit pairs + a third-bit plane, sub-scales packed
# in 4 / 6 bits), Q4_K 4.5, Q5_K 5.5, Q6_K 6.5625.
KQ_BPW = {"Q2_K": 2.625, "Q3_K": 3.4375, "Q4_K": 4.5, "Q5_K": 5.5, "Q6_K": 6.5625, "Q5_0": 5.5, "Q5_1": 6.0}


def _gguf_weight(type_name: str, n: int, k: int):
    from gguf_util import random_blocks

    from quill.formats.gguf.file import GGML_TYPE_IDS
    from quill.formats.gguf.quants import block_weight

    raw = torch.from_numpy(random_blocks(type_name, n, k, seed=n + k))
    return block_weight(raw, GGML_TYPE_IDS[type_name], "layers.0.mlp.down_proj").validate()


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q5_0", "Q5_1", "IQ4_NL"])
@pytest.mark.parametrize("int8", [False, True], ids=["float", "int8"])
def test_gguf_types_bit_exact_and_match_reference(type_name, int8):
    qw = _gguf_weight(type_name, 37, 512)
    run = qw.with_(activation=ActivationQuant()) if int8 else qw
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(3))
    outs = {isa: _run(run, x, isa, int8=int8) for isa in _variants()}  # 2/3-bit: at their stored bits
    for isa, y in outs.items():
        assert torch.equal(y, outs["scalar"]), f"{isa} differs from its scalar twin"
    flat = _run(run.single_level(), x, "scalar", int8=int8)  # one float32 scale per group
    assert torch.equal(outs["scalar"], flat)
    if qw.bits < 4:  # the same exact sums as the 4-bit layout of the same codes (the w4 fallback)
        for isa in _variants():
            assert torch.equal(_run(run.widened(4), x, isa, int8=int8), outs["scalar"]), isa
    if int8:
        want = fake_quantize_activations(x, run.activation) @ qw.dequantize().T
        assert sqnr(outs["scalar"], want) >= 40, sqnr(outs["scalar"], want)
    else:
        assert sqnr(outs["scalar"], x @ qw.dequantize().T) >= 75, sqnr(outs["scalar"], x @ qw.dequantize().T)


@pytest.mark.parametrize("type_name", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q4_1"])
@pytest.mark.parametrize("act", ["asym", "group"])
def test_two_level_int8_across_k_blocks_and_token_tiles(type_name, act):
    """13, 37 and 67 tokens (token tiles of 4-6; two row blocks a pass from 32; the AVX2 K-quant tile's groups of
    40-60 tokens, super-block by super-block) and K = 2560 (K blocks of 64 chunks cut super-blocks mid-way),
    asymmetric int8 activations per token, or llama.cpp's K-quant arithmetic (one scale per token and
    super-block, integer sub-scales, one float epilogue per super-block: csrc/avx2_super.h, avx512_super.h), on
    every variant, as the scalar twin, and within float rounding of the emulated reference."""
    aq = ActivationQuant(symmetric=False) if act == "asym" else ActivationQuant(per_group=True)
    qw = _gguf_weight(type_name, 40, 2560).with_(activation=aq)
    x = torch.randn(67, 2560, generator=torch.Generator().manual_seed(4))
    for m in (13, 37, 67):
        outs = {isa: _run(qw, x[:m], isa, int8=True) for isa in _variants()}
        for isa, y in outs.items():
            assert torch.equal(y, outs["scalar"]), f"{isa} differs from its scalar twin at M = {m}"
        want = fake_quantize_activations(x[:m], qw.activation, qw.activation_groups()) @ qw.dequantize().T
        assert sqnr(outs["scalar"], want) >= (110 if act == "group" else 40), sqnr(outs["scalar"], want)


@pytest.mark.parametrize("bits,group,per_super", [(4, 32, 1), (8, 32, 1), (4, 32, 3), (4, 16, 6)])
def test_kquant_arithmetic_on_two_level_layouts_gguf_never_writes(bits, group, per_super):
    """One activation scale per token and super-group on layouts no GGUF type has (one or three groups a
    super-group, int8 sub-scales, 8-bit codes), 1, 9 and 70 tokens (the AVX2 tile's one-pass path, its
    constants built per super-block, several token groups): every variant as the scalar twin, within float
    rounding of the emulated reference."""
    from quill.canonical import QuantizedWeight

    g = torch.Generator().manual_seed(bits + group + per_super)
    n, k = 40, 768
    groups = k // group
    qw = QuantizedWeight(torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g), bits, group,
                         torch.randint(1, 60, (n, groups), dtype=torch.int8, generator=g),
                         super_scales=(torch.rand(n, groups // per_super, generator=g) * 1e-3).half(),
                         activation=ActivationQuant(per_group=True)).validate()
    x = torch.randn(70, k, generator=g)
    for m in (1, 9, 70):
        outs = {isa: _run(qw, x[:m], isa, int8=True) for isa in _variants()}
        for isa, y in outs.items():
            assert torch.equal(y, outs["scalar"]), f"{isa} differs from its scalar twin at M = {m}"
        want = fake_quantize_activations(x[:m], qw.activation, qw.activation_groups()) @ qw.dequantize().T
        assert sqnr(outs["scalar"], want) >= 110, sqnr(outs["scalar"], want)


def test_kquant_arithmetic_one_token_is_its_batch_row_and_one_level_is_refused():
    """llama.cpp's K-quant arithmetic: one token alone (one thread) gives the bits of its row in a batch (the
    quantizer over super-blocks, then per-segment sums; the decode step's team path: test_native_step's K-quant
    mix); a one-level weight asked for one activation scale per super-block is refused by name."""
    qw = _gguf_weight("Q4_K", 40, 2560).with_(activation=ActivationQuant(per_group=True))
    x = torch.randn(7, 2560, generator=torch.Generator().manual_seed(9))
    for isa in _variants():
        rows = _run(qw, x, isa, int8=True)
        for m in (0, 6):
            assert torch.equal(_run(qw, x[m:m + 1], isa, int8=True, threads=1), rows[m:m + 1]), (isa, m)
    one = pack(_weight(32, 256), True)
    with pytest.raises(KernelError, match="one activation scale per super-block needs two-level scales"):
        EXT.module.NativeLinear(one.codes, one.scales, one.zeros, one.offsets, one.seg_end, one.src, one.wsum, 4, 32,
                                256, "int8", "scalar", act_per_segment=True, act_per_super=True)


@pytest.mark.parametrize("type_name", sorted(KQ_BPW))
def test_gguf_types_are_held_at_their_stored_bits(type_name):
    """The kernel layout reads at most the file's bits per weight + 3 % (64 x 4096: no row padding)."""
    qw = _gguf_weight(type_name, 64, 4096)
    packed = pack(qw, False)
    held = sum(t.numel() * t.element_size() for t in (packed.codes, packed.hplane, packed.scales, packed.zeros,
                                                       packed.offsets, packed.super_scales, packed.super_offsets)
               if t is not None)
    bpw = 8 * held / (64 * 4096)
    assert bpw <= KQ_BPW[type_name] * 1.03, (type_name, bpw)


@pytest.mark.parametrize("m", range(1, 18))
@pytest.mark.parametrize("offsets", [False, True], ids=["zeros", "offsets"])
def test_every_m_and_thread_count(m, offsets):
    qw = _weight(48, 128, 4, 32, False, offsets=offsets)  # offsets: Q4_1-style codes, no zero point
    qa = qw.with_(activation=ActivationQuant())
    x = torch.randn(m, 128, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    ref_f = (x.float() @ qw.dequantize().T)
    base = _run(qa, x, "scalar", int8=True, threads=1)
    base_f = {image: _run(qw, x, "scalar", int8=False, threads=1, image_bits=image) for image in IMAGES}
    for image in IMAGES:
        assert sqnr(base_f[image].float(), ref_f) >= 45
    for threads in (1, 2):
        for isa in FLOAT_VARIANTS:
            for image in IMAGES:
                assert torch.equal(_run(qw, x, isa, False, threads, image_bits=image), base_f[image])
        for isa in INT8_VARIANTS:
            assert torch.equal(_run(qa, x, isa, True, threads), base)


@pytest.mark.parametrize("bits", [3, 4, 8])
@pytest.mark.parametrize("gs", [128, -1, 40, 32])
@pytest.mark.parametrize("sym", [False, True], ids=["asym", "sym"])
def test_long_inputs_run_in_token_and_k_blocks(sym, gs, bits):
    # K = 8192: the activation block of the split stream holds 30 tokens and the int8 one 60, so
    # 70 tokens take several blocks (with a partial last one); K blocks of 64 chunks cut
    # per-channel and 40-wide (padded to 48) segments in the middle.  Symmetric: one zero point for
    # the layer, which the float kernels fold into the segment sums (carried across K blocks), and
    # 4-bit codes in segments of 32 positions also form T in int32 (common.h Weights::fuse_t)
    k = 8160 if gs == 40 else 8192
    qw = _weight(20, k, bits, gs, sym)
    qa = qw.with_(activation=ActivationQuant())
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    ref = x.float() @ qw.dequantize().T
    for image in IMAGES:
        floats = [_run(qw, x, isa, False, image_bits=image) for isa in FLOAT_VARIANTS]
        assert all(torch.equal(y, floats[0]) for y in floats), image
        assert sqnr(floats[0].float(), ref) >= 45
    # int8 per token and per segment (the latter: AVX2's 8-token tile with per-group scales at gs 32)
    for qa in (qa, qw.with_(activation=ActivationQuant(per_group=True))):
        outs = [_run(qa, x, isa, True) for isa in INT8_VARIANTS]
        assert all(torch.equal(y, outs[0]) for y in outs)
        emulated = fake_quantize_activations(x.float(), qa.activation, qw.group_index()) @ qw.dequantize().T
        assert sqnr(outs[0], emulated) >= 40


@pytest.mark.parametrize("bits", [4, 5, 8])
@pytest.mark.parametrize("sdt", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("zero", ["sym", 3, 0, "asym", "offsets"])
def test_int8_group_scales_over_token_tiles(zero, sdt, bits):
    """int8 per token and group (g32) over whole token tiles and the tokens left over (AVX2: 4-bit tiles of 8,
    tiles of 4 and fewer; AVX-512: tiles of 6, two row blocks a pass from 32 tokens), whose epilogue reads its
    token side precomputed when the layer has one zero point (csrc/scalar_util.h group_terms), every scale
    dtype, one zero point (2^(bits-1), 3: z xg rounded, 0) or per-group zeros or offsets: bit for bit the
    scalar twin, and the emulated reference."""
    k, n = 512, 40
    if isinstance(zero, int):
        from quill.canonical import QuantizedWeight
        g = torch.Generator().manual_seed(7)
        qw = QuantizedWeight(torch.randint(0, 1 << bits, (n, k), dtype=torch.uint8, generator=g), bits, 32,
                             (torch.rand(n, k // 32, generator=g) * 0.01 + 0.001).to(sdt),
                             zeros=torch.full((n, k // 32), zero, dtype=torch.int16)).validate()
    else:
        qw = _weight(n, k, bits, 32, zero == "sym", offsets=zero == "offsets", scale_dtype=sdt)
    qa = qw.with_(activation=ActivationQuant(per_group=True))
    x = torch.randn(37, k, generator=torch.Generator().manual_seed(8))
    for m in (8, 17, 37):
        outs = {isa: _run(qa, x[:m], isa, True) for isa in INT8_VARIANTS}
        for isa, y in outs.items():
            assert torch.equal(y, outs["scalar"]), f"{isa} differs from its scalar twin at M = {m}"
        emulated = fake_quantize_activations(x[:m], qa.activation, qw.group_index()) @ qw.dequantize().T
        assert sqnr(outs["scalar"], emulated) >= 40, (m, sqnr(outs["scalar"], emulated))


def test_bias_three_d_input_and_float16():
    qw = _weight(24, 64, 4, 32)
    bias = torch.randn(24)
    x = torch.randn(2, 3, 64)
    ref = x @ qw.dequantize().T + bias
    for kernel_int8, variants in ((False, FLOAT_VARIANTS), (True, INT8_VARIANTS)):
        w = qw.with_(activation=ActivationQuant()) if kernel_int8 else qw
        r = (fake_quantize_activations(x.reshape(-1, 64), w.activation).reshape(2, 3, 64) @ qw.dequantize().T + bias
             if kernel_int8 else ref)
        for isa in variants:
            y = _run(w, x, isa, kernel_int8, bias=bias)
            assert y.shape == (2, 3, 24)
            assert sqnr(y, r) >= 60
            y16 = _run(w, x.reshape(-1, 64).half(), isa, kernel_int8, bias=bias.half())
            assert y16.dtype == torch.float16 and sqnr(y16.float().reshape(2, 3, 24), r) >= 40


def test_int32_accumulation_limit_is_respected():
    # 8-bit codes 255 against activations -128 over 66000 positions would overflow one int32 segment
    k, n = 66000, 16
    codes = torch.full((n, k), 255, dtype=torch.uint8)
    from quill.canonical import QuantizedWeight
    qw = QuantizedWeight(codes, 8, k, torch.full((n, 1), 0.01), activation=ActivationQuant()).validate()
    x = torch.full((1, k), -1.0)
    ref = fake_quantize_activations(x, qw.activation) @ qw.dequantize().T
    for isa in INT8_VARIANTS:
        y = _run(qw, x, isa, int8=True)
        assert sqnr(y, ref) >= 80, isa
    assert len(stream_order(qw, 32768).seg_end) == 3


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("gs", [32, 128])
@pytest.mark.parametrize("zero", [None, 0])
def test_int16_chunk_sums_at_their_extremes(zero, gs, bits):
    # The largest codes (15, or 255 = two nibbles of 15) against activations at -amax (every part of
    # the split image -127, every int8 code -127): the kernels that add a segment's chunk sums in
    # int16 (4-bit: up to 4 chunks of 8 positions; AVX2 8-bit x int8: each nibble's over up to 8
    # chunks of 4) meet their bound -30480 exactly, and must not wrap
    k, n = 512, 32
    from quill.canonical import QuantizedWeight
    zeros = None if zero is None else torch.full((n, k // gs), zero, dtype=torch.int16)
    qw = QuantizedWeight(torch.full((n, k), 2**bits - 1, dtype=torch.uint8), bits, gs,
                         torch.full((n, k // gs), 0.01), zeros=zeros).validate()
    qa = qw.with_(activation=ActivationQuant())
    x = torch.full((9, k), -2.0)
    ref = x @ qw.dequantize().T
    ref_q = fake_quantize_activations(x, qa.activation) @ qw.dequantize().T
    for m in (1, 3, 9):  # 9: AVX2's tile of 8 tokens (with a folded zero point, its own loop) and one more
        for image in IMAGES:  # (the 16-bit image's parts are -127 too: q = -32639)
            floats = [_run(qw, x[:m], isa, False, image_bits=image) for isa in FLOAT_VARIANTS]
            assert all(torch.equal(y, floats[0]) for y in floats), image
            assert sqnr(floats[0], ref[:m]) >= 80
        ints = [_run(qa, x[:m], isa, True) for isa in INT8_VARIANTS]
        assert all(torch.equal(y, ints[0]) for y in ints)
        assert sqnr(ints[0], ref_q[:m]) >= 80


def test_preconditions_raise_kernel_error():
    qw = _weight(16, 64, 4, 32)
    h = make_handle(pack(qw, False), qw.name, qw.activation, "scalar", 1, False)
    with pytest.raises(KernelError, match=r"input should be a CPU tensor \[\.\.\., 64\], found float \[2, 63\]"):
        h.forward(torch.randn(2, 63), None)
    with pytest.raises(KernelError, match=r"input should be a CPU tensor"):
        h.forward(torch.tensor(1.0), None)
    y = h.forward(torch.randn(64, 4).T, None)  # non-contiguous input is copied, not refused
    assert y.shape == (4, 16)
    with pytest.raises(KernelError, match="dtype Int"):
        h.forward(torch.ones(2, 64, dtype=torch.int32), None)
    with pytest.raises(KernelError, match="bias"):
        h.forward(torch.randn(2, 64), torch.randn(15))
    with pytest.raises(KernelError, match="unknown ISA 'sse9'"):
        make_handle(pack(qw, False), qw.name, qw.activation, "sse9", 1, False)
    p = pack(qw, False)
    with pytest.raises(KernelError, match="'scales' should be contiguous"):
        EXT.module.NativeLinear(p.codes, p.scales[:, :, :8], None, None, p.seg_end, None, None, 4, 16, 64,
                                "float", "scalar")
    with pytest.raises(KernelError, match="threads must be at least 1"):
        h.set_threads(0)
    with pytest.raises(KernelError, match="7-bit codes are not supported; supported: 2, 3, 4, 5, 6, 8"):
        EXT.module.NativeLinear(p.codes, p.scales, None, None, p.seg_end, None, None, 7, 16, 64, "float", "scalar")
    with pytest.raises(KernelError, match="sub_bits 5 is not supported"):
        EXT.module.NativeLinear(p.codes, p.scales, None, None, p.seg_end, None, None, 4, 16, 64, "float", "scalar",
                                sub_bits=5)
    with pytest.raises(KernelError, match=r"packed sub-values \(sub_bits 4\) need super_scales"):
        EXT.module.NativeLinear(p.codes, p.scales, None, None, p.seg_end, None, None, 4, 16, 64, "float", "scalar",
                                sub_bits=4)
    wide = _weight(16, 256, 4, -1)
    p8 = pack(wide, True)  # int8 activations: one 256-position segment
    with pytest.raises(KernelError, match="float activations take segments of at most 128 positions; segment 0 "
                                          "holds 256"):
        EXT.module.NativeLinear(p8.codes, p8.scales, None, None, p8.seg_end, None, None, 4, 16, 256, "float", "scalar")
    with pytest.raises(KernelError, match="segment 0 holds 256 positions; expected 1 to 128"):
        EXT.module.split_activations(torch.randn(1, 256), p8.seg_end, 8, None, "scalar")
    q2 = pack(_gguf_weight("Q2_K", 16, 256), False)  # 4-bit packed sub-scales: [NB, S / 2, 16]
    assert q2.sub_bits == 4 and q2.scales.shape == (1, 8, 16) and q2.scales.dtype == torch.uint8
    with pytest.raises(KernelError, match=r"'scales' should be .*\[1, 8, 16\]"):
        EXT.module.NativeLinear(q2.codes, q2.scales[:, :4].contiguous(), None, q2.offsets, q2.seg_end, None, None, 2,
                                16, 256, "float", "scalar", super_scales=q2.super_scales,
                                super_offsets=q2.super_offsets, zconst=0.0, sub_bits=4)


# ---- selection ---------------------------------------------------------------------------------

from quill.kernels import KernelPolicy, KernelSelector, LinearLayerConfig, build_quant_linear  # noqa: E402
from quill.platform import Platform  # noqa: E402


@pytest.mark.parametrize("bits,activation,weight_act,expected", [
    (4, None, None, "native_w4a16"),
    (8, None, None, "native_w8a16"),
    (4, "int8", None, "native_w4a8"),
    (8, "int8", None, "native_w8a8"),
    (8, None, ActivationQuant(dynamic=False, scale=0.02), "native_w8a8"),  # a W8A8 checkpoint's own
    (3, None, None, "native_w3a16"),  # 2/3-bit codes at their stored bits
    (2, "int8", None, "native_w3a8"),
])
def test_selection_picks_native_on_this_cpu(bits, activation, weight_act, expected):
    qw = _weight(32, 64, bits, 32).with_(activation=weight_act)
    layer = build_quant_linear(qw, KernelSelector(PLATFORM), activation=activation)
    assert layer.kernel_name == expected
    x = torch.randn(3, 64)
    act = weight_act or (ActivationQuant() if activation == "int8" else None)
    ref = (x if act is None else fake_quantize_activations(x, act)) @ qw.dequantize().T
    assert sqnr(layer(x), ref) >= 40


def test_disabled_native_falls_back_to_torch():
    qw = _weight(32, 64, 4, 32)
    policy = KernelPolicy.from_env({"QUILL_DISABLED_KERNELS": "native_w4a16"})
    layer = build_quant_linear(qw, KernelSelector(PLATFORM, policy))
    assert layer.kernel_name == "torch"
    assert ("native_w4a16", "disabled by QUILL_DISABLED_KERNELS") in layer.selection.refusals


def test_float_activations_never_pick_int8_kernels():
    qw = _weight(32, 64, 4, 32)
    cfg = LinearLayerConfig.from_weight(qw, PLATFORM)
    sel = KernelSelector(PLATFORM, priorities=("native_w4a8", "native_w8a8", "torch"))
    choice = sel.select(cfg, qw.name)
    assert choice.name == "torch"
    reasons = dict(choice.refusals)
    assert "activation_quant='int8'" in reasons["native_w4a8"] and "runs 8-bit" in reasons["native_w8a8"]


def test_missing_extension_or_isa_is_a_reason_not_a_crash(monkeypatch):
    qw = _weight(32, 64, 4, 32)
    no_avx2 = Platform(vendor="Intel", flags=frozenset({"sse4_2"}))
    from quill.kernels.native import NativeW4A16Kernel
    assert NativeW4A16Kernel.supported(no_avx2) == "needs AVX2+FMA+F16C, which this CPU lacks"
    monkeypatch.setattr(native, "load", lambda: native.NativeExtension(None, "extension not built: boom"))
    assert NativeW4A16Kernel.supported(PLATFORM) == "extension not built: boom"
    layer = build_quant_linear(qw, KernelSelector(PLATFORM))
    assert layer.kernel_name == "torch"
    assert dict(layer.selection.refusals)["native_w4a16"] == "extension not built: boom"


def test_avx2_platform_prepares_the_avx2_variant():
    if not PLATFORM.has("avx2", "fma", "f16c"):
        pytest.fail("this test suite expects an AVX2 CPU")
    avx2_only = Platform(vendor="AMD", microarch="zen3", flags=frozenset({"avx2", "fma", "f16c"}), physical_cores=2)
    qw = _weight(32, 64, 4, 32)
    layer = build_quant_linear(qw, KernelSelector(avx2_only))
    assert layer.kernel_name == "native_w4a16" and layer.state.isa == "avx2"
    assert layer.state.handle.threads == 2
    x = torch.randn(2, 64)
    assert sqnr(layer(x), x @ qw.dequantize().T) >= 40
