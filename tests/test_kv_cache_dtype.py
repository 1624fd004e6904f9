"""A 16-bit KV cache (EngineConfig.kv_cache_dtype, LLM(kv_cache_dtype=...), --kv-cache-dtype): the pools
hold float16 / bfloat16 and twice the tokens fit in the same memory; the native step gives the Python
layers' bits on them; greedy decoding stays within rounding of the float32 cache; a bad name is a named
error before anything loads."""

from __future__ import annotations

import pytest
import torch

import quill
from quill import native
from quill.cli import main
from quill.default_model import default_model_path
from quill.engine.core import EngineConfig, EngineCore
from quill.errors import GenerationError
from quill.options import OptionError
from tests.model_util import hf_model, save_hf_dir
from tests.test_native_step import run

KINDS = ["float16", "bfloat16"]


@pytest.fixture(scope="module")
def llm():
    # the reference (the default is float16), on float activations: int8 ones (the GGUF default) amplify
    # the cache's rounding (docs/ACCURACY.md), and this file measures the cache alone
    return quill.LLM(default_model_path(), kv_cache_dtype="float32", activation_quant="none")


def _core(llm, **config) -> EngineCore:
    return EngineCore(llm.model, llm.eos_token_ids, llm.context_length, EngineConfig(**config),
                      isa=llm.engine.cache.isa)


def test_a_bad_kv_cache_dtype_is_named():
    with pytest.raises(GenerationError, match=r"EngineConfig.kv_cache_dtype: expected one of auto, float32, "
                                              r"float16, bfloat16, found 'fp8'"):
        EngineConfig(kv_cache_dtype="fp8")
    with pytest.raises(OptionError, match=r"kv_cache_dtype 'int8' is not supported; supported: auto, float32"):
        quill.LLM(default_model_path(), kv_cache_dtype="int8")


@pytest.mark.parametrize("kind", KINDS)
def test_pools_hold_the_type_and_twice_the_tokens(llm, kind):
    wide = _core(llm, kv_cache_memory=32 << 20, kv_cache_dtype="float32")
    narrow = _core(llm, kv_cache_memory=32 << 20, kv_cache_dtype=kind)
    assert wide.cache.keys[0].dtype == torch.float32
    assert all(t.dtype == getattr(torch, kind) for t in narrow.cache.keys + narrow.cache.values)
    assert narrow.stats().kv_blocks_total in (2 * wide.stats().kv_blocks_total, 2 * wide.stats().kv_blocks_total + 1)
    assert narrow.cache.nbytes() <= 32 << 20


@pytest.mark.skipif(native.load().module is None, reason="native kernels not built")
@pytest.mark.parametrize("team", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_the_native_step_gives_the_python_layers_bits(llm, kind, team):
    python = run(llm, False, 16, kv_cache_dtype=kind)
    assert run(llm, True, 16, team=team, kv_cache_dtype=kind) == python


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_decoding_stays_within_rounding_of_the_float32_cache(llm, kind):
    prompt = [100 + (7 * j) % 5000 for j in range(300)]  # long enough for attention to matter
    params = quill.SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=1)
    want = llm.generate([prompt], params)[0].outputs[0]
    got = quill.LLM(default_model_path(), kv_cache_dtype=kind, activation_quant="none").generate([prompt], params)
    got = got[0].outputs[0]
    same = 0  # tokens agree until a near-tie turns; log-probabilities of the agreed tokens stay close
    while same < len(want.token_ids) and got.token_ids[same] == want.token_ids[same]:
        same += 1
    assert same >= 8, (kind, same)
    diffs = [abs(got.logprobs[i][t].logprob - want.logprobs[i][t].logprob)
             for i, t in enumerate(want.token_ids[:same])]
    assert max(diffs) <= (5e-3 if kind == "float16" else 3e-2), (kind, max(diffs))  # measured 1.1e-3 / 6.0e-3


def test_the_command_line_flag(tmp_path, capsys):
    model_dir = str(save_hf_dir(hf_model("qwen2", seed=31), tmp_path / "qwen2"))
    assert main(["generate", "--model", model_dir, "--kv-cache-dtype", "float16", "--max-tokens", "6", "hi"]) == 0
    out = capsys.readouterr().out
    ref = quill.LLM(model_dir, kv_cache_dtype="float16")
    assert ref.engine.cache.keys[0].dtype == torch.float16
    greedy = quill.SamplingParams(temperature=0, max_tokens=6)
    assert out == ref.chat([{"role": "user", "content": "hi"}], greedy)[0].text + "\n"


ISAS = ["scalar"] + [name for name, flags in reversed(native.ISAS) if quill.platform.detect().has(*flags)]


@pytest.mark.skipif(native.load().module is None, reason="native kernels not built")
@pytest.mark.parametrize("kind", KINDS)
def test_stored_rows_are_the_python_paths_bits_and_float16_saturates(kind):
    """The native step's k / v store (every variant) and the Python layers' (to_pool) agree bit for bit:
    nearest-even rounding, float16 saturated at +-65504 (never inf), NaN kept."""
    from quill.engine.kv_cache import to_pool

    ext = native.load().module
    g = torch.Generator().manual_seed(0)
    special = torch.tensor([65504.0, 65519.0, 65520.0, 7e4, 3.4e38, float("inf"), float("nan"), 6e-8, 2.9e-8,
                            1e-40, 0.0, -0.0, 1.0009765625, 1.00048828125, 3.00390625])
    src = torch.cat([special, -special, torch.randn(3 * 64 - 30, generator=g) * 300]).view(3, 64).contiguous()
    want = to_pool(src, getattr(torch, kind))
    for isa in ISAS:
        pool = torch.empty(3, 64, dtype=getattr(torch, kind))
        ext.store_kv(src, pool, isa)
        nan = want.isnan()  # (NaN payloads differ even between torch's own scalar and vector paths)
        assert torch.equal(pool.isnan(), nan), isa
        assert torch.equal(pool.view(torch.int16)[~nan], want.view(torch.int16)[~nan]), isa
    if kind == "float16":
        assert not want.isinf().any() and want.isnan().sum() == 2
        assert want[0, 2] == 65504.0 and want[0, 5] == 65504.0 and want[0, 20] == -65504.0  # 65520, inf, -inf
    with pytest.raises(quill.errors.KernelError, match=r"store_kv: 'pool' should be contiguous float32, bfloat16 "
                                                       r"or float16 \[3, 64\], found double"):
        ext.store_kv(src, torch.empty(3, 64, dtype=torch.float64), "scalar")
