"""GGUF K-quants, Q5_0 / Q5_1 and IQ4_NL: read exactly (gguf-py is the oracle) and run like transformers.

Real files come from llama.cpp's own quantizer (tests/llamacpp_util.py): the default model requantized
from its Q4_1 (576-wide rows are not multiples of 256, so llama.cpp mixes in Q5_0 / Q5_1 / Q8_0 /
IQ4_NL) and a random-weight Llama whose widths are multiples of 256 (every matrix a K-quant).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from gguf_util import F16_FIELDS, without_tokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from llamacpp_util import quantize

import quill
from quill.bench.llamacpp import write_1b_gguf
from quill.canonical import QuantizedWeight
from quill.default_model import default_model_path
from quill.engine.scoring import ScoreSpec
from quill.errors import CheckpointError, ConfigError
from quill.formats.gguf.file import GGML_TYPE_IDS, GGML_TYPES, GGUFFile
from quill.formats.gguf.quants import block_weight

# every quantized type quill reads, with its code width (F16_FIELDS: its f16 fields, kept finite)
BITS = {"Q4_0": 4, "Q4_1": 4, "Q8_0": 8, "Q5_0": 5, "Q5_1": 5, "IQ4_NL": 8, "Q2_K": 2, "Q3_K": 3, "Q4_K": 4,
        "Q5_K": 5, "Q6_K": 6}
K_TYPES = {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"}
FTYPES = ("Q4_K_M", "Q4_K_S", "Q5_K_M", "Q6_K", "Q3_K_M", "Q2_K")
# the default model's requantizations (3-4 CPU seconds each): the ftypes the model tests below run; the tiny
# files hold every ftype, and each type the default model's fallbacks write is checked on generated blocks
SMOL_FTYPES = ("Q4_K_M", "Q5_K_M", "Q6_K")
# the ftype's main tensor type, which every file of that ftype must hold
MAIN_TYPE = {"Q4_K_M": "Q4_K", "Q4_K_S": "Q4_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "Q3_K_M": "Q3_K",
             "Q2_K": "Q2_K"}
PROMPT = [1, 504, 3458, 282, 4649, 314, 216, 19, 3567, 30, 378, 7]


def _bitwise_equal(a: torch.Tensor, b: np.ndarray) -> bool:
    want = torch.from_numpy(np.ascontiguousarray(b, dtype=np.float32))
    return torch.equal(a.view(torch.int32), want.view(torch.int32))


@st.composite
def blocks(draw, type_name: str):
    """Random blocks of ``type_name`` (uint8 [rows, row_bytes]) with finite f16 scale fields."""
    tid = GGML_TYPE_IDS[type_name]
    _, _, size = GGML_TYPES[tid]
    rows, per_row = draw(st.integers(1, 4)), draw(st.integers(1, 3))
    raw = np.frombuffer(draw(st.binary(min_size=rows * per_row * size, max_size=rows * per_row * size)),
                        dtype=np.uint8).copy().reshape(rows, per_row, size)
    halves = st.floats(-65504, 65504, width=16, allow_nan=False, allow_infinity=False)
    for r in range(rows):
        for b in range(per_row):
            for at in F16_FIELDS[type_name]:
                raw[r, b, at:at + 2] = np.frombuffer(np.float16(draw(halves)).tobytes(), dtype=np.uint8)
    return raw.reshape(rows, per_row * size)


@pytest.mark.parametrize("type_name", sorted(BITS))
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_generated_blocks_dequantize_like_gguf_py(type_name, data):
    raw = data.draw(blocks(type_name))
    tid = GGML_TYPE_IDS[type_name]
    qw = block_weight(torch.from_numpy(raw), tid, "w").validate()
    assert qw.bits == BITS[type_name] and qw.two_level == (type_name in K_TYPES)
    assert _bitwise_equal(qw.dequantize(), dequantize(raw, GGMLQuantizationType(tid)))
    flat = qw.single_level().validate()  # what kernels reading one float32 scale per group get
    assert not flat.two_level and torch.equal(flat.dequantize(), qw.dequantize())
    wide = qw.widened(8 if qw.bits > 4 else 4).validate()
    assert torch.equal(wide.dequantize(), qw.dequantize())
    ids = torch.tensor(data.draw(st.lists(st.integers(0, qw.out_features - 1), min_size=1, max_size=5)))
    assert torch.equal(qw.dequantize_rows(ids), qw.dequantize()[ids])  # the embedding lookup


# ---- the canonical two-level scales ------------------------------------------------

def _two_level(**kw) -> QuantizedWeight:
    base = dict(codes=torch.zeros(2, 64, dtype=torch.uint8), bits=4, group_size=16,
                scales=torch.ones(2, 4, dtype=torch.int8), super_scales=torch.ones(2, 2, dtype=torch.float16),
                name="layers.0.mlp.up_proj")
    return QuantizedWeight(**{**base, **kw})


def test_two_level_scales_formula_and_rows():
    sub = torch.tensor([[1, -2, 3, 4], [5, 6, -7, 8]], dtype=torch.int8)
    sup = torch.tensor([[0.5, 2.0], [1.0, -0.25]], dtype=torch.float16)
    codes = torch.randint(0, 16, (2, 64), dtype=torch.uint8)
    qw = _two_level(codes=codes, scales=sub, super_scales=sup).validate()
    s = sup.float().repeat_interleave(2, dim=1) * sub.float()  # [2, 4]
    want = (codes.float() - 8) * s.repeat_interleave(16, dim=1)
    assert torch.equal(qw.dequantize(), want) and qw.groups_per_super == 2
    assert torch.equal(qw.take_rows(torch.tensor([1])).dequantize(), want[1:])
    assert qw.layout() != qw.single_level().layout()


@pytest.mark.parametrize("change,message", [
    (dict(scales=torch.ones(2, 4)), "'scales' should be int"),
    (dict(super_scales=torch.ones(2, 3)), "'super_scales' should be float \\[2, S\\] with S dividing the 4 groups"),
    (dict(super_scales=torch.ones(2, 2, dtype=torch.int8)), "'super_scales' should be float"),
    (dict(super_offsets=torch.ones(2, 2)), "'super_offsets' is set but there are no offsets"),
    (dict(offsets=torch.ones(2, 4), super_offsets=torch.ones(2, 2)), "'offsets' should be int"),
])
def test_two_level_scales_are_validated(change, message):
    with pytest.raises(CheckpointError, match=message):
        _two_level(**change).validate()


def test_two_level_scales_refuse_act_order():
    with pytest.raises(ConfigError, match="two-level scales with act-order"):
        _two_level(g_idx=torch.zeros(64, dtype=torch.int32)).validate()


def test_widening_never_narrows():
    with pytest.raises(ConfigError, match="cannot widen 4-bit codes to 2 bits"):
        _two_level().widened(2)


# ---- files written by llama.cpp's quantizer -----------------------------------------

@pytest.fixture(scope="module")
def kq_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kquants")


@pytest.fixture(scope="module")
def smol(kq_dir) -> dict[str, Path]:
    """The default model in SMOL_FTYPES, requantized by llama.cpp from its Q4_1."""
    return {t: quantize(default_model_path(), kq_dir / f"smol-{t}.gguf", t) for t in SMOL_FTYPES}


@pytest.fixture(scope="module")
def tiny(kq_dir) -> dict[str, Path]:
    """A random-weight Llama (hidden 256, MLP 512, 2 layers, 8192 tokens, no tokenizer: token ids only) in
    every ftype, from an F16 copy."""
    f16 = write_1b_gguf(kq_dir, None, hidden=256, ffn=512, heads=4, kv_heads=2, layers=2, name="tiny-f16.gguf",
                        qtype="F16", vocab=8192)
    return {t: quantize(f16, kq_dir / f"tiny-{t}.gguf", t) for t in FTYPES}


def _quantized(path: Path) -> tuple[GGUFFile, list]:
    f = GGUFFile(path)
    return f, [i for i in f.tensors.values() if i.type_name not in ("F32", "F16", "BF16")]


def _check_exact(f: GGUFFile, infos) -> None:
    for info in infos:
        raw = f.raw(info.name)
        qw = block_weight(raw, info.ggml_type, info.name).validate()
        want = dequantize(raw.numpy(), GGMLQuantizationType(info.ggml_type))
        assert _bitwise_equal(qw.dequantize(), want), f"{f.path.name}: {info.name} ({info.type_name})"


@pytest.mark.parametrize("ftype", FTYPES)
def test_random_llama_files_are_all_k_quants_and_exact(tiny, ftype):
    f, infos = _quantized(tiny[ftype])
    types = Counter(i.type_name for i in infos)
    assert set(types) <= K_TYPES and MAIN_TYPE[ftype] in types, types
    _check_exact(f, infos)


@pytest.mark.parametrize("ftype", SMOL_FTYPES)
def test_default_model_files_mix_types_and_are_exact(smol, ftype):
    """Every type in the file, each checked on its first tensors (the whole file would take minutes)."""
    f, infos = _quantized(smol[ftype])
    types = Counter(i.type_name for i in infos)
    # 576-wide rows fall back to 32-blocks (Q5_0, Q5_1, Q8_0, Q4_0 or IQ4_NL); the 1536-wide ffn_down are K-quants
    assert types.keys() & K_TYPES and types.keys() - K_TYPES, types
    picked = [i for i in infos if i.name.startswith("blk.0.") or i.name == "token_embd.weight"]
    picked += [next(i for i in infos if i.type_name == t) for t in types]
    _check_exact(f, picked)


def test_q4_k_m_keeps_llama_cpp_mix(tiny):
    """Q4_K_M as llama.cpp defines it: Q4_K, with Q6_K for the output and part of attn_v / ffn_down."""
    f, infos = _quantized(tiny["Q4_K_M"])
    kind = {i.name: i.type_name for i in infos}
    assert kind["output.weight"] == "Q6_K" and kind["blk.0.attn_q.weight"] == "Q4_K"
    assert {kind[f"blk.{i}.{t}.weight"] for i in (0, 1) for t in ("attn_v", "ffn_down")} == {"Q4_K", "Q6_K"}


# ---- models from these files against transformers on the same file ---------------

@pytest.fixture(scope="module")
def hf_model():
    """transformers' float32 model from a GGUF file (its own gguf-py dequantization), loaded once per file,
    from a copy without the tokenizer (token ids only; parsing the vocabulary was most of its load)."""
    cache = {}

    def get(path: Path):
        if path not in cache:
            from transformers import AutoModelForCausalLM

            ids_only = without_tokenizer(path, path.with_name(f"{path.stem}-ids.gguf"))
            cache[path] = AutoModelForCausalLM.from_pretrained(ids_only.parent, gguf_file=ids_only.name,
                                                               dtype=torch.float32)
        return cache[path]
    return get


def _hf_logprobs(model) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT])).logits[0].float()
    return torch.log_softmax(logits, -1)[:-1]  # [n - 1, vocab]: predicts PROMPT[1:]


def _quill_logprobs(path: Path, kernel: str | None) -> tuple[torch.Tensor, quill.LLM]:
    # transformers' arithmetic: float activations and KV cache (a GGUF file's default is llama.cpp's)
    llm = quill.LLM(str(path), kernel=kernel, threads=2, progress=False, activation_quant="none",
                    kv_cache_dtype="float32", skip_tokenizer_init=True)
    n, vocab = len(PROMPT) - 1, llm.model.args.vocab_size
    spec = ScoreSpec(first=1, gather_ids=torch.arange(vocab).expand(n, -1).contiguous())
    return llm.score([PROMPT], spec)[0].gathered, llm


# every tiny file is K-quants only; the default model's (slow for transformers to load) are mixed
@pytest.mark.parametrize("model,ftype", [("tiny", "Q4_K_M"), ("tiny", "Q5_K_M"), ("tiny", "Q6_K"), ("tiny", "Q3_K_M"),
                                         ("tiny", "Q2_K"), ("smol", "Q4_K_M"), ("smol", "Q6_K")])
@pytest.mark.parametrize("kernel,tol", [("reference", 1e-4), (None, 1e-2)])
def test_next_token_logprobs_match_transformers(request, hf_model, model, ftype, kernel, tol):
    path = request.getfixturevalue(model)[ftype]
    want = _hf_logprobs(hf_model(path))
    got, llm = _quill_logprobs(path, kernel)
    err = (got - want).abs().max()
    assert float(err) <= tol, (path.name, kernel, float(err))
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    if kernel is None:  # a mixed file runs each tensor on the native kernel of its width
        bits = Counter((i.bits, i.kernel) for i in llm.loaded.layers if i.kind == "quantized")
        width = {2: "w3", 3: "w3", 4: "w4", 5: "w6", 6: "w6", 8: "w8"}  # 2/3-bit at their stored bits
        assert all(k == f"native_{width[b]}a16" for b, k in bits), bits


def _ask(path: Path, **kw) -> str:
    llm = quill.LLM(str(path), threads=2, progress=False, **kw)
    msgs = [[{"role": "user", "content": "What is the capital of France?"}]]
    return llm.chat(msgs, quill.SamplingParams(max_tokens=24, temperature=0))[0].text


def test_q5_k_m_default_model_answers_paris(smol):
    assert "Paris" in _ask(smol["Q5_K_M"])


def test_q6_k_default_model_answers_paris_with_llama_cpp_arithmetic(smol, hf_model):
    """With int8 activations (what llama.cpp's K-quant dot products do) the Q6_K model says Paris; in float
    it follows transformers' float32 forward of the same file, which answers otherwise (greedy, checked
    token for token against transformers)."""
    assert "Paris" in _ask(smol["Q6_K"], activation_quant="int8")
    path = smol["Q6_K"]
    llm = quill.LLM(str(path), threads=2, progress=False, activation_quant="none", kv_cache_dtype="float32")
    ids = llm.chat_prompt([{"role": "user", "content": "What is the capital of France?"}])
    want = hf_model(path).generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)[0, len(ids):].tolist()
    got = llm.generate([ids], quill.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0].token_ids
    assert got == want


# ---- mixture-of-experts files quantized by llama.cpp (stacked expert tensors) ----------

MOE_DIMS = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, head_dim=64,
                num_attention_heads=4, num_key_value_heads=2)


@pytest.fixture(scope="module")
def moe_files(kq_dir):
    """model_type -> (transformers model, its Q4_K_M file from an F16 copy; widths 256 so all K-quants)."""
    from tests.gguf_util import T
    from tests.moe_models_util import hf_moe_model
    from tests.test_moe_gguf import ALL_SPARSE, to_gguf

    def make(model_type: str):
        dims = dict(MOE_DIMS, **({"shared_expert_intermediate_size": 256} if model_type == "qwen2_moe" else {}))
        hf = hf_moe_model(model_type, seed=20, **{**ALL_SPARSE[model_type], **dims})
        src, _ = to_gguf(hf, model_type, kq_dir / f"{model_type}-f16.gguf", every_type=T.F16)
        return hf, quantize(src, kq_dir / f"{model_type}-Q4_K_M.gguf", "Q4_K_M")
    return make


def _moe_logprobs(path: Path, kernel: str | None, ids: list[int]) -> tuple[torch.Tensor, quill.LLM]:
    llm = quill.LLM(str(path), kernel=kernel, threads=2, progress=False, skip_tokenizer_init=True,
                    activation_quant="none", kv_cache_dtype="float32")  # transformers' arithmetic
    n, vocab = len(ids) - 1, llm.model.args.vocab_size
    spec = ScoreSpec(first=1, gather_ids=torch.arange(vocab).expand(n, -1).contiguous())
    return llm.score([ids], spec)[0].gathered, llm


MOE_IDS = [5, 17, 99, 3, 250, 61, 7, 42, 11]


@pytest.mark.parametrize("model_type", ["qwen2_moe", "qwen3_moe"])
def test_moe_q4_k_m_matches_transformers(moe_files, model_type):
    """transformers reads the same file (its config from ours: its GGUF mapping misses the expert width)."""
    from transformers import AutoModelForCausalLM

    hf, path = moe_files(model_type)
    types = Counter(i.type_name for i in _quantized(path)[1])
    assert {"Q4_K", "Q6_K"} <= types.keys(), types
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32,
                                                 config=hf.config)
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([MOE_IDS])).logits[0].float(), -1)[:-1]
    for kernel, tol in (("reference", 1e-4), (None, 1e-2)):
        got, llm = _moe_logprobs(path, kernel, MOE_IDS)
        assert float((got - want).abs().max()) <= tol, (kernel, float((got - want).abs().max()))
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        assert any(i.kind == "expert" for i in llm.loaded.layers)


def test_mixtral_style_llama_q4_k_m_native_matches_reference(moe_files):
    """transformers reads no Mixtral GGUF; the mapping is checked against it on Q4_0 files
    (test_moe_gguf.py), the blocks against gguf-py here: native kernels against the reference."""
    _, path = moe_files("mixtral")
    f, infos = _quantized(path)
    _check_exact(f, [i for i in infos if i.name.startswith("blk.0.")])
    want, _ = _moe_logprobs(path, "reference", MOE_IDS)
    got, llm = _moe_logprobs(path, None, MOE_IDS)
    assert float((got - want).abs().max()) <= 1e-2 and torch.equal(got.argmax(-1), want.argmax(-1))
