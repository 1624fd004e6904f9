"""quill.bench.qwen35: a random Qwen3.5-shaped GGUF file (the MoE one, at tiny size) is written, quantized by
llama.cpp and run in both engines; the benchmark's own shapes have the sizes it states.  That the writer
writes what llama.cpp's converter writes is tests/test_qwen3_5_gguf.py's test_bench_writer_matches_the_converter."""

import json

import pytest

import quill
from quill.bench import qwen35
from tests.llamacpp_util import llama_python


def test_bench_shapes():
    dense, moe = (qwen35.weight_counts(qwen35.SHAPES[m]) for m in ("dense", "moe"))
    assert 1.85e9 < dense["weights"] == dense["weights_per_token"] < 1.9e9  # tied: the embedding is the lm_head
    assert 2.6e9 < moe["weights"] < 2.7e9 and 1.4e9 < moe["weights_per_token"] < 1.5e9
    for s in (*qwen35.SHAPES.values(), *qwen35.TINY.values()):
        assert s.lin_k_dim == s.lin_v_dim and s.layers % s.full_attention_interval == 0


def test_the_routers_hold_bfloat16_values():
    """As a converted bf16 checkpoint's F32 routers do (quill runs them on its native 16-bit dense kernel)."""
    import numpy as np
    import torch

    x = qwen35._data(np.random.default_rng(0), "blk.0.ffn_gate_inp.weight", (8, 64))
    assert torch.equal(torch.from_numpy(x).bfloat16().float(), torch.from_numpy(x))
    y = np.random.default_rng(1).standard_normal(4096).astype(np.float32) * np.float32(1e3)
    assert torch.equal(torch.from_numpy(qwen35.bf16_values(y)), torch.from_numpy(y).bfloat16().float())
    z = qwen35._data(np.random.default_rng(0), "blk.0.ffn_up_exps.weight", (8, 64))  # the others: any float
    assert not torch.equal(torch.from_numpy(z).bfloat16().float(), torch.from_numpy(z))


def test_main_rejects_unknown_model(tmp_path, capsys):
    with pytest.raises(SystemExit):
        qwen35.main(["--llama-python", "x", "--out", str(tmp_path), "--models", "dense,nosuch"])
    assert "unknown model(s) nosuch" in capsys.readouterr().err


def test_main_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert qwen35.main(["--llama-python", llama_python(), "--out", str(tmp_path / "g"), "--tiny", "--models", "moe",
                        "--types", "q4_0", "--act-quant", "int8-group", "--prompt", "8", "--gen", "2", "--runs", "1",
                        "--threads", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "qwen35moe-tiny.Q4_0.gguf" in text and "DRAM" in text and "quill w4a8g" in text and "quill w4a16" not in text
    assert [p.name for p in (tmp_path / "g").iterdir()] == ["qwen35moe-tiny.Q4_0.gguf"]  # the F16 source is gone
    (res,) = json.loads(out.read_text())["results"]
    assert set(res["median"]) == {"quill w4a8g", "llama.cpp"} and res["shape"]["hidden"] == 256
    assert all(m[k] > 0 for m in res["median"].values() for k in ("prefill_tps", "decode_tps"))
    assert res["weights"] == qwen35.weight_counts(qwen35.TINY["moe"])["weights"]
    # what quill loaded is the shape the file was written with
    llm = quill.LLM(res["file"], threads=1, progress=False)
    args, shape = llm.model.args, qwen35.TINY["moe"]
    assert args.model_type == "qwen3_5_moe_text" and args.num_experts == shape.experts
    assert (args.hidden_size, args.num_hidden_layers, args.vocab_size) == (shape.hidden, shape.layers, shape.vocab)
