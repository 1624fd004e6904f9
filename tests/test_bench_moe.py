"""The MoE benchmarks run end to end on tiny shapes (figures are measured in bench/, never asserted)."""

import json

import torch

from quill.bench import memory
from quill.bench import moe as bench
from quill.formats.checkpoint import open_checkpoint
from quill.platform import detect

TINY = bench.MoEShape(hidden_size=64, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=96)


def test_layer_rows_count_only_the_routed_experts():
    rows = bench.bench_layer(TINY, 4, 32, [1, 6], ["grouped", "reference"], torch.float32, detect(), runs=1,
                             min_run_s=0.0, log=lambda s: None)
    assert [(r["backend"], r["tokens"]) for r in rows] == [("grouped", 1), ("grouped", 6), ("reference", 1),
                                                         ("reference", 6)]
    one_expert = bench.random_experts(TINY, 4, 32)[0].storage_bytes()
    decode = rows[0]
    assert decode["experts_read"] == 2 and abs(decode["mib_read"] * 2**20 - 2 * one_expert) < 1
    assert all(r["ms"] > 0 and r["gb_per_s"] > 0 for r in rows)


def test_checkpoint_loads_and_model_bench_reports(tmp_path):
    path = bench.write_checkpoint(tmp_path / "moe", TINY, bits=4, group=32)
    ckpt = open_checkpoint(path)
    assert ckpt.config["model_type"] == "qwen3_moe" and ckpt.quant_method == "compressed-tensors"
    names = dict(ckpt.quantized_layers())
    assert len(names) == TINY.num_hidden_layers * (4 + 3 * TINY.num_experts)
    probe = memory.Probe(1 << 20, 1, nbytes=8 << 20)
    row = bench.bench_model(path, prompt_len=8, gen_tokens=3, dtype="float32", threads=None, log=lambda s: None,
                            probe=probe)
    assert len(row["dram_probes_gbs"]) == 2 and min(row["dram_probes_gbs"]) > 0
    assert abs(row["roofline_pct"] - 100 * row["decode_gb_per_s"] / max(row["dram_probes_gbs"])) < 1e-9
    assert row["backends"] == ["grouped"] and row["decode_tokens_per_s"] > 0 and row["prefill_tokens_per_s"] > 0
    assert row["routed_expert_mib"] * TINY.num_experts == row["all_experts_mib"] * TINY.num_experts_per_tok
    json.dumps(row)


def test_command_line(tmp_path, capsys):
    out = tmp_path / "layer.json"
    assert bench.main(["layer", "--hidden", "64", "--inter", "32", "--experts", "4", "--top-k", "2", "--group", "32",
                       "--tokens", "1", "--runs", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "T=1" in text and "% of roofline against the highest DRAM read of this run" in text
    row = json.loads(out.read_text())["rows"][0]
    assert row["tokens"] == 1 and abs(row["roofline_pct"] - 100 * row["gb_per_s"] / row["roofline_gbs"]) < 1e-9


def test_the_help_names_every_moe_backend():
    """``quill bench moe-layer --help`` names the backends without importing quill.moe (and torch)."""
    from quill.bench.moe_args import BACKEND_NAMES
    from quill.moe import MOE_BACKENDS

    assert sorted(BACKEND_NAMES) == sorted(MOE_BACKENDS)
