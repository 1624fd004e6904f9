"""quill.bench.windowed end to end at tiny size: Gemma 3 (Q4_0; both engines in this process's rounds) and gpt-oss
(MXFP4_MOE; each engine in its own process per round, as the 20B runs) are written, run in both engines at a
prompt shorter and one longer than their window, and reported.  That the files are laid out as llama.cpp's
tools lay them out is tests/test_windowed_gguf.py's."""

import json

import pytest

import quill
from quill.bench import windowed, windowed_gguf
from tests.llamacpp_util import llama_python


def test_main_rejects_unknown_model_and_bad_prompts(tmp_path, capsys):
    with pytest.raises(SystemExit):
        windowed.main(["--llama-python", "x", "--out", str(tmp_path), "--models", "gemma3,nosuch"])
    assert "unknown model(s) nosuch" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        windowed.main(["--llama-python", "x", "--out", str(tmp_path), "--prompt", "128,long"])
    assert "--prompt: comma-separated integers" in capsys.readouterr().err


@pytest.mark.parametrize("model, isolate", [("gemma3", "auto"), ("gpt-oss", "on")])
def test_main_writes_json(tmp_path, capsys, monkeypatch, model, isolate):
    monkeypatch.setenv("QUILL_CACHE_DIR", str(tmp_path / "cache"))  # isolated runs inherit it
    out, shape = tmp_path / "r.json", windowed_gguf.TINY[model]
    prompts = [8, shape.window + 16]
    assert windowed.main(["--llama-python", llama_python(), "--out", str(tmp_path / "g"), "--tiny", "--models", model,
                          "--types", "q4_0", "--prompt", ",".join(map(str, prompts)), "--gen", "2", "--runs", "1",
                          "--threads", "1", "--isolate", isolate, "--json", str(out)]) == 0
    text = capsys.readouterr().out
    name = f"{shape.name}.{'Q4_0' if model == 'gemma3' else 'MXFP4_MOE'}.gguf"
    assert f"{name} p{prompts[1]}" in text and "DRAM" in text and "quill w4a8g" in text
    assert [p.name for p in (tmp_path / "g").iterdir()] == [name]  # Gemma's F16 source is gone
    results = json.loads(out.read_text())["results"]
    assert [r["prompt"] for r in results] == prompts
    for res in results:
        assert set(res["median"]) == {"quill w4a8g", "llama.cpp"} and res["model"] == model
        assert all(m[k] > 0 for m in res["median"].values() for k in ("prefill_tps", "decode_tps"))
        assert res["shape"]["hidden"] == shape.hidden
        assert res["weights"] == windowed_gguf.weight_counts(shape)["weights"]
        assert res.get("isolated", False) == (isolate == "on")
        if isolate == "on":
            assert res["quill_rss_after_load"] > 0 and res["quill_weight_bytes_per_token"] > 0
    assert not (tmp_path / "cache").exists() or not any((tmp_path / "cache").iterdir())  # no prepacked cache
    # what quill loads is the shape the file was written with, windows included
    llm = quill.LLM(results[0]["file"], threads=1, progress=False, cache=False, skip_tokenizer_init=True)
    args, specs = llm.model.args, llm.model.decoder_layer_specs()
    assert (args.hidden_size, args.num_hidden_layers, args.vocab_size) == (shape.hidden, shape.layers, shape.vocab)
    windows = [s.attention.window for s in specs]
    if model == "gemma3":
        assert windows == [shape.window if (i + 1) % 6 else None for i in range(shape.layers)]
    else:
        assert windows == [shape.window if i % 2 == 0 else None for i in range(shape.layers)]
        assert args.num_local_experts == shape.experts
