"""The quill command: generate, chat (stdin), inspect, and typed errors at the command line."""

import io
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

import quill
from quill import native
from quill.cli import main
from quill.default_model import default_model_path
from quill.errors import ConfigError
from tests.fixture_util import fixture_names, fixture_path
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


def test_generate_with_int8_activations_per_group(capsys):
    """--act-quant int8-group on the default model (a quantized GGUF): every quantized layer says so."""
    argv = ["generate", "--no-chat-template", "--max-tokens", "5", "--act-quant", "int8-group", "the capital"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    grouped = quill.LLM(activation_quant="int8-group")
    quantized = [info for info in grouped.loaded.layers if info.kind == "quantized"]
    assert quantized and all("A8 dyn/group" in info.summary for info in quantized)
    assert out == grouped.generate("the capital", quill.SamplingParams(max_tokens=5, temperature=0))[0].text + "\n"


def test_isa_avx2_runs_the_avx2_variants_with_the_same_text(capsys):
    """--isa avx2 (LLM(isa=...)): the kernel variants an AVX2-only CPU runs, on this one; every variant
    computes the same bits, so the greedy text is the native one."""
    argv = ["generate", "--isa", "avx2", "--no-chat-template", "--max-tokens", "8", "the capital"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    greedy = quill.SamplingParams(max_tokens=8, temperature=0)
    assert out == quill.LLM().generate("the capital", greedy)[0].text + "\n"
    avx2 = quill.LLM(isa="avx2")
    if quill.platform.detect().has("avx2", "fma", "f16c"):
        assert avx2.platform.isa_level == "avx2" and avx2.engine.cache.isa == "avx2"  # (the ISA chosen at load)
    with pytest.raises(ConfigError, match="sse"):
        quill.LLM(isa="sse")


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
    # the native kernels too, so the layers fall through to the oracle on any CPU
    monkeypatch.setenv("QUILL_DISABLED_KERNELS", "torch,native_w4a16,native_w8a16,native_w4a8,native_w8a8")
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
    assert "bits per weight" in out
    # its q/k/v are of different bits (built one by one)
    assert "decode step: the model's Python layers (layer 0: q_proj runs kernel reference, not a native one)" in out
    # The line's form; whether a 0.6 MiB fixture stays "within" depends on what else the test process
    # allocates meanwhile (a fresh-clone suite run measured a +31.7 MiB transient here; the bound itself
    # is checked on real loads in tests/test_loader.py and tests/test_default_model.py).
    assert re.search(r"load memory: +peak \+[\d.]+ MiB, resident \+[\d.]+ MiB; bound 1.3 x resident \+ one layer "
                     r"\([\d.]+ MiB\) = [\d.]+ MiB: (within|OVER)", out), out


def test_errors_are_reported_not_raised(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "nowhere"), "hi"]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    assert main(["inspect", str(tmp_path)]) == 2
    assert "no config.json" in capsys.readouterr().err


def _inspect_rows(capsys, model: str) -> dict[str, list[str]]:
    return _inspect(capsys, model)[0]


def _inspect(capsys, model: str) -> tuple[dict[str, list[str]], str]:
    """quill inspect's layer rows by name, and its whole output."""
    assert main(["inspect", model]) == 0
    out = capsys.readouterr().out
    header = next(i for i, line in enumerate(out.splitlines()) if line.startswith("layer "))
    rows = {}
    for line in out.splitlines()[header + 1:]:
        if not line.strip():
            break
        if not line.startswith(" "):  # indented lines explain refusals of the row above
            rows[line.split()[0]] = line.split()
    return rows, out


@pytest.mark.parametrize("name", fixture_names())
def test_inspect_names_a_kernel_for_every_layer_of_every_fixture(capsys, name):
    from quill.kernels.selection import KERNELS
    from quill.moe import MOE_BACKENDS

    rows = _inspect_rows(capsys, str(fixture_path(name)))
    quantized = [r for r in rows.values() if r[1] == "quantized"]
    experts = [r for r in rows.values() if r[1] == "expert"]  # "expert xE bits group sym moe:<backend>"
    assert quantized, f"{name}: inspect listed no quantized layer"
    for r in quantized:
        assert r[5] in KERNELS, f"{name}: {r[0]} names no registered kernel: {r}"
    for r in experts:
        assert r[6].startswith("moe:") and r[6][4:] in MOE_BACKENDS, f"{name}: {r[0]} names no MoE backend: {r}"


def test_inspect_default_model_names_a_kernel_for_every_layer(capsys):
    from quill.kernels.selection import KERNELS

    rows, out = _inspect(capsys, str(default_model_path()))
    quantized = [r for r in rows.values() if r[1] == "quantized"]
    assert len(quantized) == 30 * 7  # every projection of the 30 blocks
    assert all(r[5] in KERNELS for r in quantized)
    assert rows["model.embed_tokens"][1:6] == ["embedding", "8", "32", "yes", "lookup"]  # Q8_0, tied
    assert rows["lm_head"][1] == "tied" and rows["lm_head"][5] in KERNELS  # the Q8_0 weight through a kernel
    if native.load().module is not None:
        assert "decode step: native: every decoder layer in one call" in out


def test_min_tokens_and_ignore_eos_flags(model_dir, llm, capsys):
    argv = ["generate", "-m", model_dir, "--no-chat-template", "--max-tokens", "9", "--ignore-eos",
            "--min-tokens", "3", "the capital"]
    assert main(argv) == 0
    out, err = capsys.readouterr()
    want = llm.generate("the capital", quill.SamplingParams(max_tokens=9, temperature=0, ignore_eos=True,
                                                            min_tokens=3))[0]
    assert out == want.text + "\n" and len(want.token_ids) == 9
    assert "generation: 9 tokens" in err and "finish: length" in err


def test_chat_ctrl_c_stops_the_answer_and_keeps_the_conversation():
    """SIGINT while the default model writes a long answer: back to the prompt, no traceback, next turn works."""
    proc, got, _ = _quill_reading(["chat", "--max-tokens", "4000", "--ignore-eos"], subprocess.PIPE)
    proc.stdin.write(b"Tell me a very long story.\n")
    proc.stdin.flush()
    deadline = time.monotonic() + 120
    while len(got) < 40 and time.monotonic() < deadline:  # the answer is being written
        time.sleep(0.05)
    assert len(got) >= 40
    proc.send_signal(signal.SIGINT)
    time.sleep(0.5)
    proc.stdin.write(b"/exit\n")
    proc.stdin.flush()
    _, err = proc.communicate(timeout=120)
    err = err.decode()
    assert proc.returncode == 0, err
    assert "[interrupted]" in err and "Traceback" not in err


def _sigint_default():
    # A run started in the background by a shell without job control (`make test &`, CI runners) inherits
    # SIGINT ignored, and Python then installs no KeyboardInterrupt handler: the child gets SIGINT's
    # default disposition back, as a terminal user's has.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _quill_reading(argv: list[str], stdin=subprocess.DEVNULL) -> tuple[subprocess.Popen, bytearray, threading.Thread]:
    """``quill ARGV`` started with SIGINT's default disposition; its stdout gathered into a bytearray by a thread."""
    proc = subprocess.Popen([sys.executable, "-m", "quill", *argv], stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, preexec_fn=_sigint_default)
    got = bytearray()

    def read():
        for chunk in iter(lambda: proc.stdout.read1(256), b""):
            got.extend(chunk)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    return proc, got, reader


def _interrupted(argv: list[str], after_bytes: int = 0, after_seconds: float = 0.0) -> tuple[int, str, bytes]:
    """Run ``quill ARGV``, send SIGINT once it has written ``after_bytes`` to stdout and run ``after_seconds``;
    its exit code, stderr and stdout."""
    proc, got, reader = _quill_reading(argv)
    time.sleep(after_seconds)
    deadline = time.monotonic() + 120
    while len(got) < after_bytes and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert len(got) >= after_bytes and proc.poll() is None, "it never got that far"
    proc.send_signal(signal.SIGINT)
    err = proc.stderr.read().decode()
    proc.wait(60)
    reader.join(10)
    return proc.returncode, err, bytes(got)


def test_ctrl_c_while_generating_exits_130_without_a_traceback():
    code, err, out = _interrupted(["generate", "--max-tokens", "4000", "--ignore-eos", "Tell me a very long story."],
                                  after_bytes=40)
    assert code == 130, err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "[interrupted]"  # after notes of the load
    assert len(out) >= 40  # what was written stays written


@pytest.mark.parametrize("command, after", [("generate", 0.5), ("generate", 1.0), ("generate", 2.0), ("inspect", 1.0)])
def test_ctrl_c_while_starting_exits_130_without_a_traceback(command, after):
    """SIGINT during imports or the load, wherever it lands (torch once swallowed one during its numpy import,
    and the command ran to its end)."""
    argv = [command, "--max-tokens", "4000", "--ignore-eos", "hello"] if command == "generate" else [command]
    start = time.monotonic()
    code, err, _ = _interrupted(argv + ["--no-cache"], after_seconds=after)
    # 130, or killed by SIGINT (a shell's $? is 130 too): Python ends that way when the interrupt surfaced in
    # code an extension ran through PyRun_* (inside torch's import), even though quill caught it
    assert code in (130, -signal.SIGINT), err
    assert "Traceback" not in err and err.strip().splitlines()[-1] == "[interrupted]"  # after notes of the load
    assert time.monotonic() - start < 60


def test_inspect_without_a_model_describes_the_default_model(capsys):
    assert main(["inspect", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert f"model:      {default_model_path()}" in out
    assert re.search(r"format: .*GGUF", out, re.IGNORECASE) and "arch:       llama: 30 layers" in out


def test_readme_shell_examples_pass_what_they_show():
    """In bash, "\\n" inside double quotes is a backslash and an n: an example meaning a newline writes $'\\n'."""
    from pathlib import Path
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    blocks = re.findall(r"```(\w*)\n(.*?)```", readme, re.DOTALL)
    shell = [body for lang, body in blocks if lang in ("", "bash", "sh", "shell")]
    assert any("quill generate" in b for b in shell)
    for body in shell:
        for line in body.splitlines():
            code = line.split("  #")[0]
            assert not re.search(r'"[^"]*\\[ntr0][^"]*"', code), f"a backslash escape bash keeps as is: {line}"
    assert "--stop $'\\n\\n'" in readme
