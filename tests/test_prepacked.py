"""The prepacked cache: kernel layouts saved after a first load and read back on later ones.

Hit and miss, outputs identical with and without the cache (GGUF and safetensors formats, K-quants,
merged and unmerged projections, act-order, static int8 activations, bfloat16), invalidation when the
checkpoint's content, the kernel choice, the CPU's ISA or quill's version changes, corrupted and
truncated files (detected, deleted with a warning naming the file, rebuilt, never used), two
processes loading at once, `quill cache`. Every byte under a checksum and writers' leftovers:
tests/test_prepacked_damage.py.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from fixture_util import fixture_path
from llamacpp_util import quantize
from test_cli_startup import imported_torch

import quill
from quill.default_model import default_model_path
from quill.formats.safetensors_io import DTYPES
from quill.platform import detect
from quill.prepacked.header import DTYPE_SIZES, read_header
from quill.prepacked.store import SUFFIX, PrepackedCache

PROMPT = [1, 50, 345, 28, 464, 31, 216, 19, 356, 30, 378, 7]  # within every fixture's vocabulary (512)
GREEDY = quill.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)


def _load(model, cache_dir: Path | None, **kw) -> quill.LLM:
    llm = quill.LLM(str(model), threads=2, progress=False, cache=cache_dir is not None, cache_dir=cache_dir, **kw)
    if llm.cache is not None:
        llm.cache.wait()  # the file of a miss is written on a thread
    return llm


def _answer(llm: quill.LLM) -> tuple:
    out = llm.generate(PROMPT, GREEDY)[0]
    return out.token_ids, [{k: (v.logprob, v.rank) for k, v in d.items()} for d in out.logprobs]


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A random-weight Q4_0 Llama (hidden 256, 2 layers, 4096 token ids, no tokenizer): the cache's rules do
    not depend on the model, and it loads in a tenth of the default model's time.  Load with ``IDS``."""
    from quill.bench.llamacpp import write_1b_gguf
    return write_1b_gguf(tmp_path_factory.mktemp("small"), None, hidden=256, ffn=512, heads=4, kv_heads=2, layers=2,
                         name="small-q4_0.gguf", vocab=4096)


IDS = {"skip_tokenizer_init": True}


def _files(cache_dir: Path) -> list[Path]:
    return sorted((cache_dir / "prepacked").glob(f"*{SUFFIX}"))


@pytest.fixture(scope="module")
def q4_k_m(tmp_path_factory) -> Path:
    """The default model requantized by llama.cpp to Q4_K_M (Q4_K, Q6_K, Q5_0 / Q8_0 where rows are 576 wide)."""
    return quantize(default_model_path(), tmp_path_factory.mktemp("kq") / "q4_k_m.gguf", "Q4_K_M")


CASES = {
    "default-gguf": (lambda q: default_model_path(), {}),
    "default-w4a8": (lambda q: default_model_path(), {"activation_quant": "int8"}),
    "q4_k_m": (lambda q: q, {}),
    "awq": (lambda q: fixture_path("ar-autoawq-sym-g128-llama"), {}),
    "mixed-bits": (lambda q: fixture_path("ar-mixed-llama"), {}),
    "act-order": (lambda q: fixture_path("ct-w4a16-actorder-llama"), {"skip_tokenizer_init": True}),
    "w8a8-static-bias": (lambda q: fixture_path("ct-w8a8-static-qwen2"), {"skip_tokenizer_init": True}),
    "moe-qwen3": (lambda q: fixture_path("ct-w4a16-qwen3moe"), {"skip_tokenizer_init": True}),
    "moe-mixtral": (lambda q: fixture_path("ct-w4a16-mixtral"), {"skip_tokenizer_init": True}),
    "moe-gptq-w4a8": (lambda q: fixture_path("ar-autogptq-qwen3moe"), {"skip_tokenizer_init": True,
                                                                       "activation_quant": "int8"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_hit_gives_the_outputs_of_a_load_from_the_checkpoint(case, q4_k_m, tmp_path):
    model, kw = CASES[case]
    model = model(q4_k_m)
    plain = _load(model, None, **kw)
    miss = _load(model, tmp_path, **kw)
    assert not miss.cache_hit and len(_files(tmp_path)) == 1
    hit = _load(model, tmp_path, **kw)
    assert hit.cache_hit
    assert _answer(hit) == _answer(miss) == _answer(plain)
    assert hit.loaded.layers == plain.loaded.layers  # kernels, refusals, bytes: what `quill inspect` shows
    assert hit.eos_token_ids == plain.eos_token_ids
    if not kw.get("skip_tokenizer_init"):
        text = "The capital of France is"
        assert hit.tokenizer.encode(text) == plain.tokenizer.encode(text)
        assert hit.tokenizer.spec.facts() == plain.tokenizer.spec.facts()  # template, special tokens, ids
        if plain.tokenizer.has_chat_template:
            chat = [{"role": "user", "content": "hi"}]
            assert hit.tokenizer.apply_chat_template(chat) == plain.tokenizer.apply_chat_template(chat)
    assert "prepacked cache" in hit.loaded.checkpoint.describe()


def test_writing_the_cache_never_holds_up_the_first_answer(tmp_path, monkeypatch):
    import quill.prepacked.file as cache_file  # the writer thread imports write_file from here when it starts
    gate, real = threading.Event(), cache_file.write_file

    niceness = []

    def held_write(*args, **kw):
        niceness.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        assert gate.wait(120), "the test never released the writer"
        return real(*args, **kw)
    monkeypatch.setattr(cache_file, "write_file", held_write)
    llm = quill.LLM(str(default_model_path()), threads=2, progress=False, cache=True, cache_dir=tmp_path)
    answer = _answer(llm)  # answered while the cache file is still being written
    assert _files(tmp_path) == []
    gate.set()
    llm.cache.wait()
    assert len(_files(tmp_path)) == 1
    assert niceness == [19] and os.getpriority(os.PRIO_PROCESS, 0) < 19  # the writer yields the CPU, not the process
    assert _answer(_load(default_model_path(), tmp_path)) == answer


def test_the_cache_file_is_a_checked_safetensors_file_of_kernel_layouts(tmp_path):
    _load(default_model_path(), tmp_path)
    (path,) = _files(tmp_path)
    from safetensors import safe_open
    with safe_open(str(path), "pt") as f:  # any safetensors reader opens it
        names = list(f.keys())
        assert f.get_tensor("model.norm:weight").shape == (576,)
    assert any(n.endswith(":state.codes") for n in names)
    header = read_header(path)
    assert header.data_start % 64 == 0
    assert all(b % 64 == 0 for n, (_, _, b, _) in header.entries.items() if n.endswith(":state.codes"))
    facts = header.facts
    assert facts["source"].endswith(default_model_path().name)
    assert {"checksum", "digest", "key", "records", "config"} <= set(facts)
    assert set(facts["key"]) >= {"kernels", "activation", "dtype", "isa", "cpu_flags", "quill", "native"}


def _gguf_copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model" / "m.gguf"
    dst.parent.mkdir()
    shutil.copyfile(src, dst)
    return dst


def _flip_last_byte(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(-1, os.SEEK_END)
        b = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([b[0] ^ 0x01]))


def test_a_changed_checkpoint_misses_and_supersedes_its_old_entry(small, tmp_path):
    model = _gguf_copy(small, tmp_path)
    cache = tmp_path / "cache"
    _load(model, cache, **IDS)
    (first,) = _files(cache)
    os.utime(model)  # touched, same content: the digest is recomputed and still matches
    assert _load(model, cache, **IDS).cache_hit
    _flip_last_byte(model)  # the last weight block of the last tensor: a valid file, other content
    changed = _load(model, cache, **IDS)
    assert not changed.cache_hit
    (second,) = _files(cache)  # the old entry is gone: it can never be read again
    assert second != first
    assert _answer(changed) == _answer(_load(model, None, **IDS))
    assert _load(model, cache, **IDS).cache_hit


def test_both_float_images_share_one_entry_and_each_gets_its_own_arithmetic(small, tmp_path):
    """activation_quant "exact" and "none" pack the same layouts: one cache entry, read by either, whose
    layers then run the image asked for (the exact mode's answer is not the 16-bit image's)."""
    kw = {**IDS, "activation_quant": "none"}
    exact = {**IDS, "activation_quant": "exact"}
    _load(small, tmp_path, **kw)
    hit = _load(small, tmp_path, **exact)
    assert hit.cache_hit and len(_files(tmp_path)) == 1
    assert _answer(hit) == _answer(_load(small, None, **exact))
    assert _load(small, None, **kw).generate(PROMPT, GREEDY)[0].logprobs != hit.generate(PROMPT, GREEDY)[0].logprobs


def test_a_bfloat16_request_reads_the_float32_entry(small, tmp_path):
    """dtype="bfloat16" is not offered (it runs float32), so it shares float32's cache entry."""
    from quill.options import DtypeNotOfferedWarning
    _load(small, tmp_path, **IDS)
    with pytest.warns(DtypeNotOfferedWarning):
        assert _load(small, tmp_path, dtype="bfloat16", **IDS).cache_hit
    assert len(_files(tmp_path)) == 1


@pytest.mark.parametrize("change", ["kernel", "isa", "version"])
def test_each_part_of_the_key_invalidates(change, small, tmp_path, monkeypatch):
    model = small
    # the kernel case compares with the A16 kernels: float activations (the GGUF default is int8-group)
    base = _load(model, tmp_path, **IDS, **({"activation_quant": "none"} if change == "kernel" else {}))
    kw: dict = dict(IDS)
    if change == "kernel":
        kw |= {"activation_quant": "int8"}  # native_w4a8 / native_w8a8 instead of the A16 kernels
    elif change == "isa":
        p = detect()
        kw |= {"platform": p.limited_to("avx2") if p.has("avx512f") else
              dataclasses.replace(p, flags=p.flags | {"a_flag_this_cpu_lacks"})}
    else:
        monkeypatch.setattr(quill, "__version__", quill.__version__ + "+changed")
    before = _files(tmp_path)
    other = _load(model, tmp_path, **kw)
    assert not other.cache_hit
    after = _files(tmp_path)
    assert set(after) - set(before)
    # another quill build supersedes its entry (never read again); another choice has its own
    assert len(after) == (1 if change == "version" else 2)
    assert _load(model, tmp_path, **kw).cache_hit
    if change == "kernel":
        assert {i.kernel for i in other.loaded.layers} != {i.kernel for i in base.loaded.layers}


@pytest.mark.parametrize("damage", ["data", "truncated", "header"])
def test_a_damaged_file_is_detected_rebuilt_and_never_used(damage, small, tmp_path, caplog):
    model = small
    want = _answer(_load(model, tmp_path, **IDS))
    (path,) = _files(tmp_path)
    if damage == "data":
        _flip_last_byte(path)
    elif damage == "truncated":
        with open(path, "r+b") as f:
            f.truncate(path.stat().st_size - 1000)
    else:
        with open(path, "r+b") as f:
            f.seek(9)
            f.write(b"}}}}")
    with caplog.at_level("WARNING", logger="quill.prepacked"):
        llm = _load(model, tmp_path, **IDS)
    assert not llm.cache_hit
    assert f"deleted {path}, unusable: " in caplog.text and "rebuilding" in caplog.text
    assert {"data": "the data's checksum differs", "truncated": "truncated",
            "header": "the header does not begin with its 'header_checksum'"}[damage] in caplog.text
    assert _answer(llm) == want
    assert _load(model, tmp_path, **IDS).cache_hit  # rebuilt whole


def test_a_kernel_that_does_not_save_its_state_loads_uncached(small, tmp_path):
    # float activations: the torch kernel has none per group (the GGUF default)
    llm = _load(small, tmp_path, kernel="torch", activation_quant="none", **IDS)
    assert not llm.cache_hit and _files(tmp_path) == []
    assert _answer(llm) == _answer(_load(small, None, kernel="torch", activation_quant="none", **IDS))


def test_an_moe_backend_that_does_not_save_its_state_loads_uncached(tmp_path):
    model = fixture_path("ct-w4a16-qwen3moe")
    llm = _load(model, tmp_path, skip_tokenizer_init=True, moe_backend="reference")
    assert not llm.cache_hit and _files(tmp_path) == []
    assert _answer(llm) == _answer(_load(model, None, skip_tokenizer_init=True, moe_backend="reference"))


CHILD = """
import json, sys, quill
llm = quill.LLM(sys.argv[1], threads=1, progress=False, cache=True, cache_dir=sys.argv[2], skip_tokenizer_init=True)
out = llm.generate([1, 504, 3458, 282], quill.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
print(json.dumps({"hit": llm.cache_hit, "ids": out.token_ids}))
"""


def _children(model: Path, cache: Path, n: int) -> list[dict]:
    env = {**os.environ, "QUILL_CACHE": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", CHILD, str(model), str(cache)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(n)]
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-2000:]
        outs.append(json.loads(out.strip().splitlines()[-1]))
    return outs


def test_two_processes_loading_at_once_leave_one_whole_file(small, tmp_path):
    model = small
    first = _children(model, tmp_path, 2)
    assert first[0]["ids"] == first[1]["ids"]
    files = list((tmp_path / "prepacked").iterdir())
    assert len(files) == 1 and files[0].suffix == SUFFIX  # no temporary file left, no torn one
    read_header(files[0])
    again = _children(model, tmp_path, 1)[0]
    assert again["hit"] and again["ids"] == first[0]["ids"]


def test_quill_cache_list_and_clear(tmp_path):
    """Each command a fresh process, which reads headers only and never imports torch."""
    _load(default_model_path(), tmp_path)
    out, torch_loaded = imported_torch(["cache", "list", "--cache-dir", str(tmp_path)])
    assert "1 file(s)" in out and "SmolLM2-135M-Instruct.Q4_1.gguf" in out and not torch_loaded
    assert "native_w4a" in out  # native_w4a16, or native_w4a8 where GGUF runs int8 activations
    out, torch_loaded = imported_torch(["cache", "clear", "--cache-dir", str(tmp_path)])
    assert "removed" in out and _files(tmp_path) == [] and not torch_loaded
    out, torch_loaded = imported_torch(["cache", "list", "--cache-dir", str(tmp_path)])
    assert "0 file(s)" in out and not torch_loaded


def test_the_header_reader_knows_every_dtype_size():
    """quill.prepacked.header sizes tensors without torch: its table must agree with torch's."""
    assert DTYPE_SIZES == {name: dtype.itemsize for name, dtype in DTYPES.items()}


def test_the_cli_reads_and_writes_the_cache_unless_told_not_to(tmp_path):
    env = {**os.environ, "QUILL_CACHE": "1", "QUILL_CACHE_DIR": str(tmp_path)}
    cmd = [sys.executable, "-m", "quill", "generate", "Hi", "--max-tokens", "4", "--quiet"]
    subprocess.run(cmd + ["--no-cache"], capture_output=True, text=True, check=True, env=env)
    assert _files(tmp_path) == []
    first = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    assert len(_files(tmp_path)) == 1
    second = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    assert second.stdout == first.stdout


def test_the_cache_directory_defaults(monkeypatch, tmp_path):
    monkeypatch.delenv("QUILL_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert PrepackedCache().directory == tmp_path / "quill"
    monkeypatch.setenv("QUILL_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert PrepackedCache().directory == tmp_path / "elsewhere"
    assert PrepackedCache(tmp_path / "given").directory == tmp_path / "given"


def _mapped_rss_kib(path: Path) -> int:
    """Resident KiB of this process's mappings of ``path`` (/proc/self/smaps)."""
    total, ours = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if line[:1].isalnum() and "-" in line.split()[0] and len(line.split()) >= 5:
            ours = line.split()[-1] == str(path)
        elif ours and line.startswith("Rss:"):
            total += int(line.split()[1])
    return total


def test_the_kernels_read_the_mapped_file_and_embedding_rows_come_on_demand(tmp_path):
    want = _answer(_load(default_model_path(), tmp_path))
    llm = _load(default_model_path(), tmp_path)
    (path,) = _files(tmp_path)
    header = read_header(path)
    table = sum(e - b for n, (_, _, b, e) in header.entries.items() if n.startswith("model.embed_tokens:"))
    assert table > 20 << 20  # the default model's Q8_0 embedding, in canonical form
    resident = _mapped_rss_kib(path) * 1024
    assert 0 < resident < header.data_len - table // 2  # the kernels' pages, not the table's
    head = llm.model.lm_head.impl.state.packed.codes
    assert head.is_contiguous() and path.stat().st_size > head.numel()
    assert _answer(llm) == want  # rows looked up after their pages were let go read the file again


def _flip(path: Path, at: int, mask: int = 0x01) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ mask]))
