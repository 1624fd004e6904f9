"""quill bench: the kernel benchmark runs end to end (tiny shapes) and the model-benchmark checkpoint reads back."""

import json
import sys

import pytest
import torch

from quill.bench.checkpoint import LlamaShape, write_llama_w4
from quill.cli import main
from quill.formats.checkpoint import open_checkpoint


def test_bench_kernels_tiny_run(tmp_path, capsys):
    out = tmp_path / "k.json"
    rc = main(["bench", "kernels", "--shapes", "64x128", "--m", "1,3", "--runs", "1", "--min-run-ms", "0",
               "--probe-mib", "8", "--kernels", "native_w4a16,native_w4a8,torch_w4,fp32", "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "DRAM read bandwidth" in text and "N x K = 64 x 128" in text and "W4A8 vs W4A16" in text
    data = json.loads(out.read_text())
    cells = {(r["kernel"], r["m"]) for r in data["results"]}
    assert cells == {(k, m) for k in ("native_w4a16", "native_w4a8", "torch_w4", "fp32") for m in (1, 3)}
    r = next(r for r in data["results"] if r["kernel"] == "native_w4a16" and r["m"] == 1)
    assert r["weight_bytes"] == 64 * 128 // 2 + 64 * 128 // 128 * 2 and r["speedup"]["torch"] > 0
    assert data["accuracy"][0]["w4a8_vs_w4a16_db"] > 25


def test_bench_rejects_unknown_kernel(capsys):
    assert main(["bench", "kernels", "--kernels", "nosuch"]) == 2
    assert "unknown benchmark kernel(s) nosuch" in capsys.readouterr().err


def test_llama_checkpoint_reads_back(tmp_path):
    shape = LlamaShape(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=2, vocab_size=100)
    path = write_llama_w4(tmp_path / "ckpt", group_size=32, shape=shape)
    ckpt = open_checkpoint(path)
    layers = dict(ckpt.quantized_layers())
    assert len(layers) == 15 and ckpt.config["num_key_value_heads"] == 2  # 2 x 7 projections + lm_head
    assert layers["lm_head"].out_features == 100 and ckpt.config["tie_word_embeddings"] is False
    qw = layers["model.layers.1.mlp.down_proj"]
    assert (qw.out_features, qw.in_features, qw.bits, qw.group_size) == (64, 128, 4, 32)
    dense = dict(ckpt.dense_tensors())
    assert dense["model.embed_tokens.weight"].shape == (100, 64)
    assert dense["model.embed_tokens.weight"].dtype == torch.bfloat16
    tied = open_checkpoint(write_llama_w4(tmp_path / "tied", group_size=32, shape=shape, lm_head="tied"))
    assert len(dict(tied.quantized_layers())) == 14 and tied.config["tie_word_embeddings"] is True


def test_bench_linears_on_a_fixture(capsys):
    from tests.fixture_util import fixture_path
    assert main(["bench", "linears", str(fixture_path("ct-w4a16-sym-g128-llama")), "--tokens", "1", "--runs", "1"]) == 0
    out = capsys.readouterr().out
    assert "selected 14 linears" in out and "'native_w4a16': 14" in out and "torch    14 linears" in out


def test_bench_linears_per_group_activations(capsys):
    from tests.fixture_util import fixture_path
    assert main(["bench", "linears", str(fixture_path("ct-w4a16-sym-g128-llama")), "--tokens", "1", "--runs", "1",
                 "--act-quant", "int8-group"]) == 0
    out = capsys.readouterr().out
    assert "'native_w4a8': 14" in out


def test_bench_model_tiny_run(tmp_path, capsys):
    shape = LlamaShape(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                       num_hidden_layers=2, vocab_size=100)
    path = write_llama_w4(tmp_path / "ckpt", group_size=32, shape=shape)
    out = tmp_path / "m.json"
    assert main(["bench", "model", str(path), "--prompt", "8", "--gen", "4", "--batch", "2", "--runs", "2",
                 "--modes", "w4a16,w4a8,w4a8g", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "w4a16" in text and "w4a8" in text and "roofline" in text
    data = json.loads(out.read_text())
    modes = {m["mode"]: m for m in data["modes"]}
    assert set(modes) == {"w4a16", "w4a8", "w4a8g"}
    m = modes["w4a16"]
    assert m["kernels"] == {"native_w4a16": 15}
    assert len(m["samples"]["decode_tps"]) == len(m["samples"]["dram_gbs"]) == len(m["pct_of_roofline_per_run"]) == 2
    assert m["samples"]["dram_gbs"][0] > 0 and m["decode_tps"] > 0
    # bytes per decoded token: every linear as stored, plus the KV cache averaged over positions 8 .. 11
    assert m["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4 * (8 + 1.5) // 1
    assert modes["w4a8"]["kernels"] == {"native_w4a8": 15}
    assert modes["w4a8g"]["kernels"] == {"native_w4a8": 15} and modes["w4a8g"]["decode_tps"] > 0


def test_llamacpp_bench_writes_a_gguf_quill_runs(tmp_path):
    import quill
    from quill.bench import llamacpp as mod
    from quill.engine.hub import default_model

    path = mod.write_1b_gguf(tmp_path, default_model(), hidden=64, ffn=128, heads=4, kv_heads=2, layers=2,
                             name="tiny.gguf")
    # each arithmetic the bench compares runs on its native kernel, whatever the GGUF default is
    kernels = {"quill w4a16": "native_w4a16", "quill w4a16 exact": "native_w4a16", "quill w4a8": "native_w4a8",
               "quill w4a8g": "native_w4a8"}
    assert set(mod.QUILL_MODES) == set(kernels)
    for engine, act_quant in mod.QUILL_MODES.items():
        llm = quill.LLM(str(path), threads=1, progress=False, activation_quant=act_quant)
        assert {i.kernel for i in llm.loaded.layers if i.kind == "quantized"} == {kernels[engine]}, engine
    assert llm.model.args.hidden_size == 64 and llm.model.args.num_hidden_layers == 2
    out = mod.run_quill(llm, 5, 3)
    assert out["decode_tps"] > 0 and out["prefill_tps"] > 0
    assert llm.tokenizer.encode("Hello") == quill.LLM(str(default_model()), progress=False).tokenizer.encode("Hello")


def test_the_gguf_benches_run_the_modes_asked_for(capsys):
    import argparse

    from quill.bench import llamacpp as mod
    ap = argparse.ArgumentParser()
    mod.add_modes_arg(ap)
    assert mod.parse_modes(ap, ap.parse_args([]).act_quant) == mod.QUILL_MODES
    assert mod.parse_modes(ap, "int8-group,none") == {"quill w4a16": "none", "quill w4a8g": "int8-group"}
    for bad in ("int4", ","):
        with pytest.raises(SystemExit):
            mod.parse_modes(ap, bad)
    assert "unknown mode(s) int4; known: none, exact, int8, int8-group" in capsys.readouterr().err


def test_bench_load_against_llamacpp(tmp_path, capsys):
    from tests.llamacpp_util import llama_python
    out = tmp_path / "load.json"
    assert main(["bench", "load", "--runs", "1", "--generate", "--llama-python", llama_python(),
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ratio quill / llama.cpp" in text and "ratio quill, no cache / llama.cpp" in text
    data = json.loads(out.read_text())
    (model, res), = data["models"].items()
    for mode in ("cold", "warm"):
        for engine in ("quill", "quill, no cache", "llama.cpp"):
            s = res[mode][engine]
            assert s["load_s"] > 0 and s["peak_mb"] >= s["rss_mb"] > 0
        assert res[mode]["quill"]["cache_hits"] == 1  # the timed quill runs read the bench's own cache
        assert res[mode]["quill, no cache"]["cache_hits"] == 0
    base = data["baseline"]["quill (import torch, quill)"]["rss_mb"]
    assert res["warm"]["quill"]["rss_mb"] > base  # the model is in memory on top of the runtime
    gen = data["generate"][model]
    assert set(gen) == {"import torch", "quill generate", "quill generate, no cache", "llama-cpp-python chat"}
    for r in gen.values():
        assert 0 < r["first_s"] <= r["exit_s"] and r["peak_mb"] > 0
    assert main(["bench", "load", "--model", str(tmp_path / "nope.gguf")]) == 2


def test_peer_specs_are_checked_before_any_run():
    from quill.bench.peers import Peer
    from quill.errors import ConfigError

    for spec, message in (("ik_llama.cpp", "expected NAME=PATH"), ("ik=", "expected NAME=PATH"),
                          ("ik=/nonexistent/llama-bench -rtr 1", "no llama-bench at '/nonexistent/llama-bench'"),
                          (f"ik={sys.executable} -c pass", "is not a llama-bench")):
        with pytest.raises(ConfigError, match=message):
            Peer.parse(spec)


def test_step_profile_of_the_default_model():
    """The decode-step profile on a model whose layers all keep keys and values (state_specs() is None: the
    profile once crashed there); its rows account for the step."""
    from quill.bench.step_profile import profile_file
    from quill.default_model import default_model_path
    from quill.native import load

    ext = load().module
    ext.step_profile_enable(True)  # what QUILL_STEP_PROFILE=1 turns on for the command
    try:
        r = profile_file(default_model_path(), "int8-group", 16, 6, 1)
    finally:
        ext.step_profile_enable(False)  # process-wide: off again for the tests after this one
    assert r["tokens"] == 5 and r["ms_per_token"] > 0
    rows = r["rows"]
    assert rows["step: mlp_gate_up"]["mb"] > 0 and rows["step: mlp_gate_up"]["gbs"] > 0
    assert sum(v["ms"] for v in rows.values()) == pytest.approx(r["ms_per_token"], rel=1e-6)


def test_compute_probe_reads_a_rate_and_restores_torchs_threads():
    from quill.bench import memory
    probe = memory.Probe(1 << 20, 2, nbytes=8 << 20)
    saved = torch.get_num_threads()
    one = probe.compute_gflops(threads=1, runs=2)
    assert torch.get_num_threads() == saved
    # 16 float32 matmuls of 256^3 a timing: a rate well above 1 GFLOP/s on any core quill runs on, finite
    assert 1.0 < one < 1e4
