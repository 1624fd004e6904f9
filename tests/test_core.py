"""Canonical weight, packing and safetensors access."""

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quill.canonical import ActivationQuant, QuantizedWeight
from quill.errors import CheckpointError, ConfigError, UnsupportedFormatError
from quill.formats.packing import pack_int32, unpack_int32
from quill.formats.safetensors_io import SafetensorsFile, TensorStore
from quill.writers.rtn import quantize_rtn


@settings(max_examples=60, deadline=None)
@given(bits=st.sampled_from([2, 3, 4, 8]), rows=st.integers(1, 5), n=st.integers(1, 80), dim=st.sampled_from([0, 1]),
       seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_round_trip(bits, rows, n, dim, seed):
    g = torch.Generator().manual_seed(seed)
    vals = torch.randint(0, 1 << bits, (rows, n), generator=g, dtype=torch.int32)
    if dim == 0:
        vals = vals.T.contiguous()
    packed = pack_int32(vals, bits, dim)
    assert packed.dtype == torch.int32
    assert packed.shape[dim] == -(-n * bits // 32)
    assert torch.equal(unpack_int32(packed, bits, dim, count=n).to(torch.int32), vals)


@settings(max_examples=30, deadline=None)
@given(words=st.integers(1, 6), seed=st.integers(0, 2**31 - 1))
def test_pack_unpack_with_order(words, seed):
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    g = torch.Generator().manual_seed(seed)
    vals = torch.randint(0, 16, (3, words * 8), generator=g, dtype=torch.int32)
    packed = pack_int32(vals, 4, 1, order=order)
    assert torch.equal(unpack_int32(packed, 4, 1, order=order).to(torch.int32), vals)
    # slot i of each word really holds column order[i]
    word = int(packed[0, 0]) & 0xFFFFFFFF
    for slot, col in enumerate(order):
        assert (word >> (4 * slot)) & 0xF == int(vals[0, col])


def test_known_packing_bits():
    # 0x76543210 holds 0..7 lowest nibble first
    packed = torch.tensor([[0x76543210]], dtype=torch.int32)
    assert unpack_int32(packed, 4, 1).tolist() == [[0, 1, 2, 3, 4, 5, 6, 7]]
    neg = torch.tensor([[-1]], dtype=torch.int32)  # 0xFFFFFFFF
    assert unpack_int32(neg, 8, 1).tolist() == [[255, 255, 255, 255]]


def test_dequantize_formula_by_hand():
    codes = torch.tensor([[0, 15, 8, 9]], dtype=torch.uint8)
    scales = torch.tensor([[0.5, -2.0]], dtype=torch.float16)
    sym = QuantizedWeight(codes, 4, 2, scales).validate()
    assert sym.dequantize().tolist() == [[-4.0, 3.5, 0.0, -2.0]]
    zeros = torch.tensor([[1, 9]], dtype=torch.int16)
    asym = QuantizedWeight(codes, 4, 2, scales, zeros=zeros).validate()
    assert asym.dequantize().tolist() == [[-0.5, 7.0, 2.0, 0.0]]
    offs = torch.tensor([[1.0, -1.0]], dtype=torch.float16)
    q41 = QuantizedWeight(codes, 4, 2, scales, zeros=torch.zeros(1, 2, dtype=torch.int16), offsets=offs).validate()
    assert q41.dequantize().tolist() == [[1.0, 8.5, -17.0, -19.0]]
    g_idx = torch.tensor([1, 0, 0, 1], dtype=torch.int32)
    ao = QuantizedWeight(codes, 4, 2, scales, g_idx=g_idx).validate()
    assert ao.dequantize().tolist() == [[16.0, 3.5, 0.0, -2.0]]


def test_validate_errors_name_the_layer():
    codes = torch.zeros(4, 6, dtype=torch.uint8)
    with pytest.raises(ConfigError, match="lay.*group_size 4 does not divide in_features 6"):
        QuantizedWeight(codes, 4, 4, torch.ones(4, 1), name="lay").validate()
    with pytest.raises(UnsupportedFormatError, match="bits=7"):
        QuantizedWeight(codes, 7, 3, torch.ones(4, 2), name="lay").validate()
    with pytest.raises(CheckpointError, match="'scales'"):
        QuantizedWeight(codes, 4, 3, torch.ones(3, 2), name="lay").validate()
    with pytest.raises(CheckpointError, match="above the 4-bit maximum"):
        QuantizedWeight(codes + 16, 4, 3, torch.ones(4, 2), name="lay").validate()


def test_activation_quant_rules():
    with pytest.raises(ConfigError):
        ActivationQuant(dynamic=False)
    with pytest.raises(UnsupportedFormatError):
        ActivationQuant(bits=4)
    assert ActivationQuant(dynamic=False, scale=0.1).scale == 0.1


@pytest.mark.parametrize("bits,gs,sym,ao,off", [(4, 32, True, False, False), (4, 64, False, True, False),
                                                 (8, -1, True, False, False), (4, 32, False, False, True)])
def test_rtn_is_close_to_float(bits, gs, sym, ao, off):
    w = torch.randn(16, 128) * 0.02
    qw = quantize_rtn(w, bits, gs, sym, ao, off, generator=torch.Generator().manual_seed(1))
    err = (qw.dequantize() - w).pow(2).mean() / w.pow(2).mean()
    assert err < (0.02 if bits == 4 else 1e-4)


def _write_safetensors(path, tensors, truncate=0):
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        b = t.contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": {torch.float32: "F32", torch.int32: "I32"}[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header).encode()
    data = struct.pack("<Q", len(h)) + h + b"".join(blobs)
    path.write_bytes(data[: len(data) - truncate])


def test_safetensors_read_and_truncation(tmp_path):
    t = {"a.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
         "b.qweight": torch.arange(4, dtype=torch.int32)}
    _write_safetensors(tmp_path / "model.safetensors", t)
    store = TensorStore(tmp_path)
    assert torch.equal(store.get("a.weight"), t["a.weight"])
    assert torch.equal(store.get("b.qweight"), t["b.qweight"])
    with pytest.raises(CheckpointError, match="'nope' is missing"):
        store.get("nope")
    _write_safetensors(tmp_path / "model.safetensors", t, truncate=5)
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsFile(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00")
    with pytest.raises(CheckpointError, match="truncated"):
        SafetensorsFile(tmp_path / "model.safetensors")
