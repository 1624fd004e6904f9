"""One options spec (quill.options.RunOptions): every entry point builds it from its own input (CLI
flags of every model command, `quill serve --replicas`, Ray's build_app, lm-eval's model_args) and
hands it to quill.LLM unchanged; and the defaults a user of each format gets (GGUF: llama.cpp's int8
activations, float16 KV cache; the HF formats: their tools' float forward)."""

from __future__ import annotations

import dataclasses
import inspect
import warnings
from pathlib import Path

import pytest

import quill
from quill.cli import build_parser, main
from quill.cli.common import run_options
from quill.default_model import default_model_path
from quill.engine.core import KV_CACHE_DTYPES
from quill.errors import ConfigError, KernelSelectionError
from quill.options import KV_CACHE_DTYPES as SPEC_KV_CACHE_DTYPES
from quill.options import ActQuant, OptionError, RunOptions

REAL = Path(__file__).resolve().parent / "data" / "real"
# every field away from its default, as flags and as the options object they must give
FLAGS = ["--dtype", "bfloat16", "--act-quant", "none", "--kv-cache-dtype", "float32", "--threads", "3",
         "--kernel", "native_w4a16", "--moe-backend", "reference", "--isa", "avx2", "--max-model-len", "99",
         "--offline", "--no-cache", "--cache-dir", "/tmp/quill-options-test",
         "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}']
SPEC = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
WANT = RunOptions(dtype="float32", activation_quant="none", kv_cache_dtype="float32", threads=3, kernel="native_w4a16",
                  moe_backend="reference", isa="avx2", max_model_len=99, offline=True, cache=False,
                  cache_dir="/tmp/quill-options-test", speculative_config=SPEC)
# each model command with what it needs besides the options
COMMANDS = {"generate": ["generate", "hi"], "chat": ["chat"], "inspect": ["inspect", "model.gguf"], "serve": ["serve"],
            "eval perplexity": ["eval", "perplexity", "--pydoc-topics"],
            "eval compare": ["eval", "compare", "--pydoc-topics"]}


def assert_same(got: RunOptions, want: RunOptions, where: str) -> None:
    for f in dataclasses.fields(RunOptions):
        assert getattr(got, f.name) == getattr(want, f.name), (where, f.name)


def parse(argv: list[str]):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # --dtype bfloat16's "runs as float32"
        return build_parser(argv[0]).parse_args(argv)


def test_llm_takes_every_field_with_the_same_default():
    params = inspect.signature(quill.LLM.__init__).parameters
    for f in dataclasses.fields(RunOptions):
        assert f.name in params and params[f.name].kind is inspect.Parameter.KEYWORD_ONLY, f.name
        assert params[f.name].default == f.default, f.name
    assert SPEC_KV_CACHE_DTYPES == KV_CACHE_DTYPES


@pytest.mark.parametrize("command", COMMANDS)
def test_every_model_command_parses_its_flags_into_the_spec(command):
    argv = COMMANDS[command]
    assert_same(run_options(parse(argv)), RunOptions(), command)
    with pytest.warns(quill.options.DtypeNotOfferedWarning):  # bfloat16 is accepted and runs as float32
        assert_same(run_options(parse(argv + FLAGS)), WANT, command)


def test_eval_compare_other_flags_override_only_what_they_name():
    args = parse(COMMANDS["eval compare"] + ["--act-quant", "int8", "--other-act-quant", "none",
                                             "--other-kv-cache-dtype", "float32", "--threads", "2"])
    other = run_options(args, prefix="other_")
    assert_same(other, RunOptions(activation_quant="none", kv_cache_dtype="float32", threads=2), "OTHER")
    assert_same(run_options(args), RunOptions(activation_quant="int8", threads=2), "BASE")


def test_bench_commands_take_the_spec_flags():
    lin = parse(["bench", "linears", "--act-quant", "none"])
    assert lin.activation_quant == "none"
    assert parse(["bench", "linears"]).activation_quant == "auto"
    k = parse(["bench", "kernels", "--threads", "2", "--isa", "avx2"])
    assert (k.threads, k.isa) == (2, "avx2")
    with pytest.raises(SystemExit):
        parse(["bench", "linears", "--act-quant", "int4"])


def test_serve_replicas_carry_every_option(monkeypatch, capsys):
    """--no-cache, --cache-dir, --isa, ... reach each replica's LLM keywords (they were dropped before)."""
    ray = pytest.importorskip("quill.serving.ray")
    seen = []
    monkeypatch.setattr(ray, "serve_on_ray", lambda options, *a, **kw: seen.append(options) or 0)
    flags = [f for f in FLAGS if f not in ("--threads", "3")]  # one engine's threads: --threads-per-replica
    with pytest.warns(quill.options.DtypeNotOfferedWarning):
        assert main(["serve", "--replicas", "2", "--threads-per-replica", "1", *flags,
                     "--tool-call-parser", "mistral", "--reasoning-parser", "none"]) == 0
    kwargs = seen[0].replica_llm_kwargs
    assert_same(RunOptions(**kwargs), dataclasses.replace(WANT, threads=1), "serve --replicas")
    assert (seen[0].tool_call_parser, seen[0].reasoning_parser) == ("mistral", "none")  # the ingress's parsers
    assert main(["serve", "--replicas", "2", "--threads", "3"]) == 2
    assert "with replicas use --threads-per-replica" in capsys.readouterr().err


def test_build_app_takes_every_option_as_strings():
    ray = pytest.importorskip("quill.serving.ray")
    options = ray.build_options({"replicas": "2", "threads_per_replica": "1", "isa": "avx2", "cache": "false",
                                 "offline": "true", "activation_quant": "none", "kv_cache_dtype": "float32",
                                 "max_model_len": "99", "cache_dir": "/tmp/c", "max_num_seqs": "4",
                                 "speculative_config": '{"method": "ngram", "num_speculative_tokens": 2}'})
    want = RunOptions(isa="avx2", cache=False, offline=True, activation_quant="none", kv_cache_dtype="float32",
                      max_model_len=99, cache_dir="/tmp/c", threads=1, speculative_config=SPEC)
    assert_same(RunOptions(**options.replica_llm_kwargs), want, "build_app")
    assert options.engine_config.max_num_seqs == 4
    with pytest.raises(ConfigError, match="unknown argument 'threads'.*threads_per_replica"):
        ray.build_options({"threads": "2"})
    with pytest.raises(OptionError, match="isa 'sse' is not supported; supported: native, avx2"):
        ray.build_options({"isa": "sse"})
    with pytest.raises(ConfigError, match="each replica runs threads_per_replica threads"):
        ray.RayServeOptions(llm={"threads": 2})
    parsers = ray.build_options({"tool_call_parser": "llama3_json", "reasoning_parser": "deepseek_r1"})
    assert (parsers.tool_call_parser, parsers.reasoning_parser) == ("llama3_json", "deepseek_r1")
    with pytest.raises(ConfigError, match="tool_call_parser: unknown parser 'harmony'; known: auto, hermes"):
        ray.build_options({"tool_call_parser": "harmony"})
    with pytest.raises(ConfigError, match="reasoning_parser: unknown parser 'r1'; known: auto, none, qwen3"):
        ray.build_options({"reasoning_parser": "r1"})


def test_a_replica_llm_runs_what_the_options_say(tmp_path):
    """The replica's keywords as quill.LLM takes them: isa, cache, activations and KV cache arrive."""
    ray = pytest.importorskip("quill.serving.ray")
    options = ray.build_options({"replicas": "1", "isa": "avx2", "cache": "false", "activation_quant": "none",
                                 "kv_cache_dtype": "float32", "speculative_config": '{"method": "ngram"}'})
    llm = quill.LLM(options.model, engine_config=options.engine_config, progress=False, **options.replica_llm_kwargs)
    assert llm.options == RunOptions(**options.replica_llm_kwargs)
    assert llm.cache is None and llm.platform.isa_level == "avx2" and llm.activation is ActQuant.NONE
    assert llm.engine.kv_cache_dtype == "float32"
    assert llm.engine.speculator is not None and llm.engine.config.speculative.num_speculative_tokens == 3


def test_lm_eval_model_args_are_the_spec():
    lm_eval = pytest.importorskip("quill.integrations.lm_eval")
    args = "pretrained={},activation_quant=none,kv_cache_dtype=float32,isa=avx2,cache=false,threads=1,max_model_len=64"
    lm = lm_eval.QuillLM.create_from_arg_string(args.format(default_model_path()),
                                                {"batch_size": 1, "max_batch_size": None, "device": "cpu"})
    assert_same(lm.llm.options, RunOptions(activation_quant="none", kv_cache_dtype="float32", isa="avx2",
                                           cache=False, threads=1, max_model_len=64), "lm-eval")
    assert lm.llm.activation is ActQuant.NONE  # "none" (which lm-eval parses to None) is float, GGUF too
    with pytest.warns(quill.formats.registry.QuillDeprecationWarning, match="act_quant.*activation_quant"):
        assert lm_eval.run_options({"act_quant": "int8"}).activation_quant == "int8"
    with pytest.raises(OptionError, match="QuillLM: unknown option.*bogus"):
        lm_eval.run_options({"bogus": 1})


def test_bad_values_name_the_option():
    with pytest.raises(OptionError, match="activation_quant: None is not an option; 'auto'"):
        RunOptions(activation_quant=None)
    with pytest.raises(OptionError, match="kv_cache_dtype 'int8' is not supported; supported: auto, float32"):
        RunOptions(kv_cache_dtype="int8")
    with pytest.raises(OptionError, match="cache: expected true or false, found 'maybe'"):
        RunOptions.from_mapping({"cache": "maybe"}, "here")


# ---- the defaults --------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def default_llm():
    return quill.LLM(default_model_path(), progress=False)


def test_gguf_runs_llama_cpp_arithmetic_by_default(default_llm):
    assert default_llm.activation is ActQuant.INT8_GROUP and default_llm.engine.kv_cache_dtype == "float16"
    quantized = [i for i in default_llm.loaded.layers if i.kind == "quantized"]
    assert quantized and all("A8 dyn/group" in i.summary for i in quantized)
    assert "GGUF default, llama.cpp's arithmetic; --act-quant none for float" in default_llm.arithmetic["activations"]
    assert "--kv-cache-dtype float32" in default_llm.arithmetic["KV cache"]


def test_none_means_float_even_for_gguf():
    llm = quill.LLM(default_model_path(), activation_quant="none", kv_cache_dtype="float32", progress=False)
    assert llm.activation is ActQuant.NONE and llm.engine.kv_cache_dtype == "float32"
    assert all("A16" in i.summary for i in llm.loaded.layers if i.kind == "quantized")
    assert llm.arithmetic == {"activations": "float, a 16-bit image in native kernels (--act-quant none)",
                              "KV cache": "float32 (--kv-cache-dtype float32)"}


def test_a_forced_kernel_without_the_gguf_default_says_how_to_run_float():
    with pytest.raises(KernelSelectionError, match=r"kernel 'torch' was forced.*--act-quant none runs them in float"):
        quill.LLM(default_model_path(), kernel="torch", progress=False, cache=False)
    assert quill.LLM(default_model_path(), kernel="torch", activation_quant="none", progress=False,
                     cache=False).activation is ActQuant.NONE


@pytest.mark.parametrize("name, words", [
    ("awq-w4a16", "float, a 16-bit image in native kernels (default for this format"),
    ("w8a8", "int8 where the checkpoint prescribes it (W8A8")])
def test_hf_formats_keep_their_tools_arithmetic(name, words):
    llm = quill.LLM(str(REAL / name), skip_tokenizer_init=True, progress=False)
    assert llm.activation is ActQuant.NONE and llm.arithmetic["activations"].startswith(words)


def test_inspect_and_the_load_line_say_which_arithmetic_runs(capsys):
    assert main(["inspect", str(default_model_path())]) == 0
    captured = capsys.readouterr()
    assert "activations: int8 per token and weight group (GGUF default, llama.cpp's arithmetic" in captured.out
    assert "KV cache:   float16 (default" in captured.out
    assert "quill: activations: int8 per token and weight group" in captured.err  # the load line
    assert main(["inspect", str(default_model_path()), "--act-quant", "none", "--quiet"]) == 0
    captured = capsys.readouterr()
    assert "activations: float, a 16-bit image in native kernels (--act-quant none)" in captured.out
    assert captured.err == ""
