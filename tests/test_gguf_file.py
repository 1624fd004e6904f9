"""The GGUF container parser against files written by the gguf package, and against corrupt bytes."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
from gguf import GGUFReader
from gguf_util import T, V, pack_string, raw_gguf, write_gguf

from quill.errors import CheckpointError, UnsupportedFormatError
from quill.formats.gguf.file import GGUFFile

SCALARS = [
    ("t.u8", 200, V.UINT8, "uint8"), ("t.i8", -100, V.INT8, "int8"),
    ("t.u16", 60000, V.UINT16, "uint16"), ("t.i16", -30000, V.INT16, "int16"),
    ("t.u32", 4_000_000_000, V.UINT32, "uint32"), ("t.i32", -2_000_000_000, V.INT32, "int32"),
    ("t.u64", 2**63 + 5, V.UINT64, "uint64"), ("t.i64", -(2**62), V.INT64, "int64"),
    ("t.f32", 0.1, V.FLOAT32, "float32"), ("t.f64", 0.1, V.FLOAT64, "float64"),
    ("t.bool_t", True, V.BOOL, "bool"), ("t.bool_f", False, V.BOOL, "bool"),
    ("t.str", "héllo ✨ wörld", V.STRING, "string"), ("t.str_empty", "", V.STRING, "string"),
]
ARRAYS = [
    ("a.u8", [0, 1, 255], V.UINT8), ("a.i8", [-128, 0, 127], V.INT8), ("a.u16", [1, 65535], V.UINT16),
    ("a.i16", [-5, 5], V.INT16), ("a.u32", [7, 2**32 - 1], V.UINT32), ("a.i32", [-1, 3, 2**31 - 1], V.INT32),
    ("a.u64", [2**64 - 1], V.UINT64), ("a.i64", [-(2**63), 9], V.INT64), ("a.f32", [0.5, -1.25, 3e-8], V.FLOAT32),
    ("a.f64", [0.1, -2.5], V.FLOAT64), ("a.bool", [True, False, True], V.BOOL),
    ("a.str", ["a", "", "日本語", "<|im_end|>"], V.STRING),
]


@pytest.fixture
def every_type(tmp_path):
    kv = [(k, v, t) for k, v, t, _ in SCALARS] + [(k, v, V.ARRAY, t) for k, v, t in ARRAYS]
    kv.append(("a.nested", [[1, 2], [3]], V.ARRAY, V.ARRAY))
    rng = np.random.default_rng(0)
    tensors = [
        ("w.f32", rng.standard_normal((3, 5)).astype(np.float32), T.F32),
        ("w.f16", rng.standard_normal((4, 2, 6)).astype(np.float32), T.F16),
        ("w.q8", rng.standard_normal((2, 64)).astype(np.float32), T.Q8_0),
        ("w.vec", rng.standard_normal(7).astype(np.float32), T.F32),
    ]
    return write_gguf(tmp_path / "every.gguf", "llama", kv, tensors), tensors


def test_metadata_of_every_type(every_type):
    path, _ = every_type
    f = GGUFFile(path)
    assert f.version == 3 and f.metadata["general.architecture"] == "llama"
    for key, value, _, type_name in SCALARS:
        assert f.value_types[key] == type_name
        if type_name == "float32":
            assert f.metadata[key] == float(np.float32(value))
        else:
            assert f.metadata[key] == value and type(f.metadata[key]) is type(value)
    for key, value, vtype in ARRAYS:
        expect = [float(np.float32(v)) for v in value] if vtype == V.FLOAT32 else value
        assert f.metadata[key] == expect, key
        assert f.value_types[key][0] == "array"
    assert f.metadata["a.nested"] == [[1, 2], [3]]
    assert f.value_types["a.nested"] == ("array", "array")


def test_metadata_and_tensor_table_match_gguf_reader(every_type):
    path, tensors = every_type
    f, ref = GGUFFile(path), GGUFReader(path)
    for key, field in ref.fields.items():
        if key.startswith("GGUF.") or key == "a.nested":
            continue
        assert f.metadata[key] == field.contents(), key
    assert list(f.tensors) == [t.name for t in ref.tensors]
    assert f.data_offset == ref.data_offset
    for t in ref.tensors:
        info = f.tensors[t.name]
        assert info.ggml_type == int(t.tensor_type) and info.shape == tuple(int(d) for d in t.shape)
        assert info.offset == t.data_offset and info.nbytes == t.n_bytes
        assert info.offset % f.alignment == 0
    for name, data, qtype in tensors:
        if qtype == T.F32:
            assert torch.equal(f.array(name, torch.float32), torch.from_numpy(data))
        elif qtype == T.F16:
            assert torch.equal(f.array(name, torch.float16), torch.from_numpy(data.astype(np.float16)))
    assert f.tensors["w.f16"].torch_shape == (4, 2, 6) and f.tensors["w.f16"].shape == (6, 2, 4)


def test_tensors_are_zero_copy_views_of_the_file(every_type):
    path, _ = every_type
    f = GGUFFile(path)
    a, b = f.array("w.f32", torch.float32), f.array("w.f32", torch.float32)
    assert a.data_ptr() == b.data_ptr()
    raw = f.raw("w.q8")  # [rows, row_bytes] = [2, 2 blocks x 34 bytes]
    assert raw.shape == (2, 68) and raw.dtype == torch.uint8
    with open(path, "rb") as fh:
        fh.seek(f.tensors["w.q8"].offset)
        assert bytes(raw.flatten().numpy()) == fh.read(f.tensors["w.q8"].nbytes)


@pytest.mark.parametrize("alignment", [8, 64, 256])
def test_custom_alignment(tmp_path, alignment):
    rng = np.random.default_rng(1)
    tensors = [(f"t{i}", rng.standard_normal((3, 32 * (i + 1))).astype(np.float32), T.F32) for i in range(3)]
    path = write_gguf(tmp_path / "a.gguf", "llama", (), tensors, alignment=alignment)
    f = GGUFFile(path)
    assert f.alignment == alignment and f.data_offset % alignment == 0
    assert f.data_offset == GGUFReader(path).data_offset
    for name, data, _ in tensors:
        assert (f.tensors[name].offset - f.data_offset) % alignment == 0
        assert torch.equal(f.array(name, torch.float32), torch.from_numpy(data))


def test_version_2_reads_like_version_3(every_type, tmp_path):
    path, _ = every_type
    blob = bytearray(path.read_bytes())
    blob[4:8] = struct.pack("<I", 2)
    v2 = tmp_path / "v2.gguf"
    v2.write_bytes(bytes(blob))
    f2, f3 = GGUFFile(v2), GGUFFile(path)
    assert f2.version == 2 and f2.metadata == f3.metadata and f2.tensors.keys() == f3.tensors.keys()


@pytest.mark.parametrize("version, hint", [(1, ""), (4, ""), (0x03000000, "big-endian")])
def test_unsupported_version(tmp_path, version, hint):
    p = tmp_path / "v.gguf"
    p.write_bytes(raw_gguf(version=version))
    with pytest.raises(UnsupportedFormatError, match=f"version {version} is not supported.*{hint}.*supported: 2, 3"):
        GGUFFile(p)


def test_not_a_gguf_file(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(raw_gguf(magic=b"GGML"))
    with pytest.raises(CheckpointError, match="not a GGUF file"):
        GGUFFile(p)


def test_every_truncation_raises_checkpoint_error(every_type, tmp_path):
    """Cut the file at every length: always a CheckpointError naming the file, never another exception."""
    path, _ = every_type
    blob = path.read_bytes()
    f = GGUFFile(path)
    end = max(i.offset + i.nbytes for i in f.tensors.values())  # the file may be padded after this
    cut_points = sorted(set(range(0, f.data_offset + 64)) | {end - 1, end - 34})
    p = tmp_path / "cut.gguf"
    for n in cut_points:
        p.write_bytes(blob[:n])
        with pytest.raises(CheckpointError, match="cut.gguf.*truncated") as e:
            GGUFFile(p)
        assert "cut.gguf" in str(e.value)


def _kv_u32(key, value):
    return (key, V.UINT32, struct.pack("<I", value))


@pytest.mark.parametrize("kvs, tensors, data, message", [
    ([("k", V.STRING, struct.pack("<Q", 2**60))], [], b"", "length of|needs"),
    ([("k", V.ARRAY, struct.pack("<IQ", V.STRING, 2**40))], [], b"", "claims .* elements"),
    ([("k", V.ARRAY, struct.pack("<IQ", V.UINT32, 2**50))], [], b"", "needs"),
    ([("k", V.STRING, pack_string(b"\xff\xfe"))], [], b"", "not valid UTF-8"),
    # string arrays (a vocabulary) are read by their own loop: the same checks, the element named
    ([("k", V.ARRAY, struct.pack("<IQ", V.STRING, 2) + pack_string(b"ok") + pack_string(b"\xff"))], [], b"",
     r"'k'\[1\] at offset \d+ is not valid UTF-8"),
    ([("k", V.ARRAY, struct.pack("<IQ", V.STRING, 2) + pack_string(b"ok") + struct.pack("<Q", 2**40))], [], b"",
     r"'k'\[1\] needs 1099511627776 bytes"),
    ([("k", 13, b"")], [], b"", "value type 13"),
    ([("k", V.ARRAY, struct.pack("<IQ", 77, 1))], [], b"", "element type 77"),
    ([_kv_u32("k", 1), _kv_u32("k", 2)], [], b"", "appears twice"),
    ([_kv_u32("general.alignment", 24)], [], b"", "power-of-two"),
    ([("general.alignment", V.UINT64, struct.pack("<Q", 32))], [], b"", "power-of-two uint32"),
    ([], [("w", (4, 1, 1, 1, 1), 0, 0)], b"\0" * 16, "at most 4"),
    ([], [("w", (4,), 0, 0), ("w", (4,), 0, 32)], b"\0" * 48, "twice"),
    ([], [("w", (4,), 0, 4)], b"\0" * 48, "not a multiple of the alignment"),
    ([], [("w", (33, 2), 2, 0)], b"\0" * 128, "multiple of 32"),
    ([], [("w", (4, 4), 0, 0)], b"\0" * 60, "truncated GGUF file: tensor 'w'"),
])
def test_corrupt_fields(tmp_path, kvs, tensors, data, message):
    p = tmp_path / "bad.gguf"
    p.write_bytes(raw_gguf(kvs, tensors, data))
    with pytest.raises(CheckpointError, match=message):
        GGUFFile(p)


def test_unknown_ggml_type_id(tmp_path):
    p = tmp_path / "bad.gguf"
    p.write_bytes(raw_gguf([], [("blk.0.attn_q.weight", (4,), 99, 0)], b"\0" * 32))
    with pytest.raises(UnsupportedFormatError, match="'blk.0.attn_q.weight' has unknown ggml type id 99.*Q4_0"):
        GGUFFile(p)


def test_empty_array_and_zero_tensors(tmp_path):
    p = tmp_path / "e.gguf"
    p.write_bytes(raw_gguf([("a", V.ARRAY, struct.pack("<IQ", V.INT32, 0)), _kv_u32("general.alignment", 16)],
                           alignment=16))
    f = GGUFFile(p)
    assert f.metadata == {"a": [], "general.alignment": 16} and f.tensors == {}


def test_missing_file(tmp_path):
    with pytest.raises(CheckpointError, match="cannot open"):
        GGUFFile(tmp_path / "nope.gguf")


def test_release_pages_keeps_every_byte(tmp_path):
    """After loading, the map's pages are released: unwritten ones dropped (read back from the file),
    written ones (private copies) kept."""
    from quill.formats.gguf.file import _copied_kb
    p = tmp_path / "w.gguf"
    data = bytes(range(256)) * 64
    p.write_bytes(raw_gguf([], [("w", (4096,), 0, 0)], data))
    f = GGUFFile(p)
    before = bytes(f._map[:])
    assert _copied_kb(f._map) == 0
    f.release_pages()
    assert bytes(f._map[:]) == before  # dropped pages fault back in from the file
    f._map[-4:] = b"QUIL"  # a private write (ACCESS_COPY): must survive a release
    assert _copied_kb(f._map) > 0
    f.release_pages()
    assert bytes(f._map[-4:]) == b"QUIL" and bytes(f._map[:-4]) == before[:-4]
    assert p.read_bytes() == before  # and the file itself never changes
