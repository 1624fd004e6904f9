"""quill bench spec: the speculative-decoding benchmark end to end against quill serve on the default model (tiny
settings; llama-server is not part of the test run), and its options refused before anything starts."""

import json

import pytest

from quill.cli import main


def test_bench_spec_none_and_ngram_on_the_default_model(tmp_path, capsys):
    out = tmp_path / "spec.json"
    assert main(["bench", "spec", "--methods", "none,ngram", "--k", "2", "--max-tokens", "16", "--clients", "1,2",
                 "--rounds", "1", "--prompts", "1", "--threads", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "1 client(s)" in text and "2 client(s)" in text and "goal quill ngram copy" in text
    data = json.loads(out.read_text())
    assert data["meta"]["command"].startswith("quill bench spec") and data["meta"]["threads"] == 1
    assert data["settings"]["k"] == 2 and [len(p) for p in data["settings"]["prompts"].values()] == [1, 1]
    (res,) = data["results"]
    assert res["draft"] is None and set(res["servers"]) == {"quill none", "quill ngram"}
    assert '"num_speculative_tokens": 2' in " ".join(res["servers"]["quill ngram"])
    assert set(res["levels"]) == {"1", "2"}
    for clients, level in res["levels"].items():
        assert set(level) == {"copy", "chat"}
        for entry in level.values():
            assert entry["headline"] == ("decode_tok_s" if clients == "1" else "output_tok_s")
            configs = entry["configs"]
            assert set(configs) == {"quill none", "quill ngram"}
            for c in configs.values():
                (r,) = c["rounds"]
                assert r["errors"] == 0 and r["requests"] == (1 if clients == "1" else 4)
                m = c["median"]
                assert m["decode_tok_s"] > 0 and m["output_tok_s"] > 0 and 0 < m["tokens_per_request"] <= 16
                assert m["acceptance"] is None or 0 <= m["acceptance"] <= 1
                assert 0 <= m["accepted_tokens"] <= m["draft_tokens"]
            assert configs["quill none"]["median"]["draft_tokens"] == 0
            assert configs["quill none"]["median"]["acceptance"] is None
            assert entry["speedup"]["quill ngram"] > 0 and entry["quill_vs_llama_server"] == {}
            if clients == "1":  # greedy: speculation changes no token
                assert configs["quill ngram"]["rounds"][0]["tokens"] == configs["quill none"]["rounds"][0]["tokens"]
        copy = level["copy"]["configs"]["quill ngram"]["median"]
        assert copy["draft_tokens"] > 0 and 0 <= copy["acceptance"] <= 1  # "repeat this text" drafts
    goals = {(g["set"], g["clients"]): g["goal"] for g in res["goals"]}
    assert goals == {("copy", 1): 1.5, ("chat", 1): 0.97, ("copy", 2): 0.95, ("chat", 2): 0.95}  # more: a few % at most
    assert data["settings"]["goals"]["more than one client"] == 0.95


@pytest.mark.parametrize("flags, message", [
    (["--k", "0"], "--k: expected an integer >= 1, found 0"),
    (["--clients", "1,x"], "--clients '1,x': expected comma-separated integers >= 1"),
    (["--methods", "none,eagle"], "--methods 'none,eagle': unknown eagle; supported: none, ngram, draft"),
    (["--llama-server", "/nonexistent/llama-server"], "--llama-server: no executable file '/nonexistent/llama-server'"),
    (["--methods", "none,draft"], "--methods draft: no draft model: pass --draft"),
    (["--draft", "/nonexistent/draft.gguf"], "--draft: no such file '/nonexistent/draft.gguf'"),
])
def test_bench_spec_refuses_bad_options_before_starting(flags, message, capsys):
    assert main(["bench", "spec", *flags]) == 2
    err = capsys.readouterr()
    assert message in err.err and err.out == ""
