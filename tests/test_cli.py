"""The quill command: generate, chat (stdin), inspect, and typed errors at the command line."""

import io

import pytest

import quill
from quill.cli import main
from tests.fixture_util import fixture_path
from tests.model_util import hf_model, save_hf_dir

GREEDY = quill.SamplingParams(temperature=0, max_tokens=6)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_hf_dir(hf_model("qwen2", seed=31), tmp_path_factory.mktemp("cli") / "qwen2"))


@pytest.fixture(scope="module")
def llm(model_dir):
    return quill.LLM(model_dir)


def test_generate_streams_the_chat_answer(model_dir, llm, capsys):
    assert main(["generate", "--model", model_dir, "--max-tokens", "6", "hello world"]) == 0
    out, err = capsys.readouterr()
    want = llm.chat([{"role": "user", "content": "hello world"}], GREEDY)[0].text
    assert out == want + "\n"
    assert "generation: 6 tokens" in err and "finish: length" in err


def test_generate_raw_prompt_and_sampling_flags(model_dir, llm, capsys):
    argv = ["generate", "-m", model_dir, "--no-chat-template", "--max-tokens", "5", "--temperature", "0.8",
            "--top-k", "20", "--top-p", "0.9", "--min-p", "0.01", "--seed", "7", "--repetition-penalty", "1.1",
            "--threads", "1", "--act-quant", "int8", "the capital"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    w4a8 = quill.LLM(model_dir, activation_quant="int8", threads=1)
    sp = quill.SamplingParams(max_tokens=5, temperature=0.8, top_k=20, top_p=0.9, min_p=0.01, seed=7,
                              repetition_penalty=1.1)
    assert out == w4a8.generate("the capital", sp)[0].text + "\n"


def test_chat_reads_stdin_with_reset_and_exit(model_dir, llm, capsys, monkeypatch):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\nagain\n/reset\nhello\n/exit\nnever read\n"))
    assert main(["chat", "--model", model_dir, "--max-tokens", "6"]) == 0
    replies = capsys.readouterr().out.splitlines()
    first = llm.chat([{"role": "user", "content": "hello"}], GREEDY)[0].text
    second = llm.chat([{"role": "user", "content": "hello"}, {"role": "assistant", "content": first},
                       {"role": "user", "content": "again"}], GREEDY)[0].text
    assert "\n" not in first + second
    assert replies == [first, second, first]  # after /reset the history is gone


def test_inspect_reports_layers_kernels_and_memory(capsys, monkeypatch):
    monkeypatch.setenv("QUILL_DISABLED_KERNELS", "torch")
    assert main(["inspect", str(fixture_path("ar-mixed-llama"))]) == 0
    out = capsys.readouterr().out
    assert "auto-round" in out and "extra_config" in out
    rows = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(("model.", "lm_head"))}
    assert len(rows) == 16  # the embedding and 15 linear layers
    assert rows["model.embed_tokens"][1:6] == ["embedding", "-", "-", "-", "lookup"]
    assert rows["model.layers.0.self_attn.q_proj"][1:6] == ["quantized", "8", "ch", "yes", "reference"]
    assert rows["model.layers.0.mlp.down_proj"][1:6] == ["quantized", "8", "32", "yes", "reference"]
    assert rows["model.layers.1.mlp.gate_proj"][1:6] == ["dense", "-", "-", "-", "dense"]
    assert out.count("skipped torch: disabled by QUILL_DISABLED_KERNELS") == 12
    assert "bits per weight" in out and "load memory:" in out and "within" in out


def test_errors_are_reported_not_raised(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "hi"]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err
