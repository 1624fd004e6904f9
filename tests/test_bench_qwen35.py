"""quill.bench.qwen35: the random Qwen3.5-shaped GGUF files (dense and MoE) are written, quantized by llama.cpp,
and run in both engines (tiny shapes); the benchmark's own shapes have the sizes it states.  That the writer
writes what llama.cpp's converter writes is tests/test_qwen3_5_gguf.py's test_bench_writer_matches_the_converter."""

import json

import pytest
import torch

import quill
from quill.bench import qwen35
from quill.bench.llamacpp import run_llamacpp
from quill.engine.hub import default_model
from quill.models.base import ForwardContext
from tests.llamacpp_util import llama_python


@pytest.mark.parametrize("model,qtype", [("dense", "q4_k_m"), ("moe", "q4_0")])
def test_tiny_file_runs_in_quill_and_llamacpp(tmp_path, model, qtype):
    (path, shape), = qwen35.write_models(tmp_path, [model], [qtype], llama_python(), default_model(), tiny=True,
                                         log=lambda _: None)
    assert path.name == f"{shape.name}.{qtype.upper()}.gguf"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # the F16 source is gone
    llm = quill.LLM(str(path), threads=1, progress=False)
    args = llm.model.args
    assert args.model_type == ("qwen3_5_moe_text" if model == "moe" else "qwen3_5_text")
    assert (args.hidden_size, args.num_hidden_layers, args.vocab_size) == (shape.hidden, shape.layers, shape.vocab)
    assert getattr(args, "num_experts", 0) == shape.experts
    ids = torch.tensor([[(7 * i + 11) % 4000 + 100 for i in range(12)]])
    with torch.inference_mode():
        logits = llm.model(ids, ForwardContext.causal(1, 12))
    assert torch.isfinite(logits).all() and logits.float().std() > 0
    out = llm.generate(["Hello"], quill.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert len(out.token_ids) == 3
    lc = run_llamacpp(llama_python(), path, 8, 3, 1)
    assert lc["decode_tps"] > 0 and lc["prefill_tps"] > 0


def test_bench_shapes():
    dense, moe = (qwen35.weight_counts(qwen35.SHAPES[m]) for m in ("dense", "moe"))
    assert 1.85e9 < dense["weights"] == dense["weights_per_token"] < 1.9e9  # tied: the embedding is the lm_head
    assert 2.6e9 < moe["weights"] < 2.7e9 and 1.4e9 < moe["weights_per_token"] < 1.5e9
    for s in (*qwen35.SHAPES.values(), *qwen35.TINY.values()):
        assert s.lin_k_dim == s.lin_v_dim and s.layers % s.full_attention_interval == 0


def test_main_rejects_unknown_model(tmp_path, capsys):
    with pytest.raises(SystemExit):
        qwen35.main(["--llama-python", "x", "--out", str(tmp_path), "--models", "dense,nosuch"])
    assert "unknown model(s) nosuch" in capsys.readouterr().err


def test_main_writes_json(tmp_path, capsys):
    out = tmp_path / "r.json"
    assert qwen35.main(["--llama-python", llama_python(), "--out", str(tmp_path / "g"), "--tiny", "--models", "dense",
                        "--types", "q4_0", "--act-quant", "int8-group", "--prompt", "8", "--gen", "2", "--runs", "1",
                        "--threads", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "qwen35-tiny.Q4_0.gguf" in text and "DRAM" in text and "quill w4a8g" in text and "quill w4a16" not in text
    (res,) = json.loads(out.read_text())["results"]
    assert set(res["median"]) == {"quill w4a8g", "llama.cpp"} and res["shape"]["hidden"] == 256
    assert res["weights"] == qwen35.weight_counts(qwen35.TINY["dense"])["weights"]
