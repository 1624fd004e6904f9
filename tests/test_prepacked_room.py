"""The prepacked cache stays within its limits: $QUILL_CACHE_MAX_SIZE and the space it leaves free on its disk
($QUILL_CACHE_MIN_FREE), deleting the least recently used files first (a hit counts as a use); a file that
cannot fit is not written and the load goes on."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import pytest
from test_cli_startup import imported_torch

import quill
from quill.errors import ConfigError
from quill.prepacked.room import MAX_SIZE_ENV, MIN_FREE_ENV, Room, parse_size
from quill.prepacked.store import SUFFIX

GIB = 1 << 30
PROMPT = [1, 50, 345, 28, 464, 31, 216, 19]
GREEDY = quill.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def small(tmp_path_factory) -> Path:
    """A random-weight Q4_0 Llama (hidden 256, 2 layers): the cache's rules do not depend on the model."""
    from quill.bench.llamacpp import write_1b_gguf
    return write_1b_gguf(tmp_path_factory.mktemp("small"), None, hidden=256, ffn=512, heads=4, kv_heads=2, layers=2,
                         name="small-q4_0.gguf", vocab=4096)


def _load(model: Path, cache_dir: Path, act: str) -> quill.LLM:
    llm = quill.LLM(str(model), threads=2, progress=False, cache=True, cache_dir=cache_dir, activation_quant=act,
                    skip_tokenizer_init=True)
    llm.cache.wait()  # a miss's file is written on a thread
    return llm


def _files(cache_dir: Path) -> dict[str, Path]:
    """Each cache file by the activation arithmetic it was built for."""
    from quill.prepacked.header import read_header
    out = {}
    for path in (cache_dir / "prepacked").glob(f"*{SUFFIX}"):
        out[read_header(path).facts["key"]["activation"]] = path
    return out


def _age(path: Path, seconds_ago: float) -> None:
    t = path.stat().st_mtime - seconds_ago
    os.utime(path, (t, t))


def test_sizes_and_shares_parse_and_bad_values_name_the_variable():
    assert parse_size("123456", MAX_SIZE_ENV) == 123456
    assert parse_size("500M", MAX_SIZE_ENV) == 500 << 20 and parse_size("1.5g", MAX_SIZE_ENV) == int(1.5 * GIB)
    assert parse_size("2GiB", MAX_SIZE_ENV) == 2 * GIB and parse_size("40 GB", MAX_SIZE_ENV) == 40 * GIB
    assert parse_size("5%", MIN_FREE_ENV, share=True) == pytest.approx(0.05)
    assert Room.from_env({}) == Room(None, 2 * GIB)
    assert Room.from_env({MAX_SIZE_ENV: "10G", MIN_FREE_ENV: "10%"}) == Room(10 * GIB, 0.1)
    for env, name in (({MAX_SIZE_ENV: "lots"}, MAX_SIZE_ENV), ({MAX_SIZE_ENV: "5%"}, MAX_SIZE_ENV),
                      ({MIN_FREE_ENV: "-1G"}, MIN_FREE_ENV), ({MIN_FREE_ENV: "150%"}, MIN_FREE_ENV)):
        with pytest.raises(ConfigError, match=name):
            Room.from_env(env)


def test_the_plan_deletes_the_least_recently_used_until_the_file_fits():
    files = [(Path("new"), 30, 300.0), (Path("old"), 30, 100.0), (Path("mid"), 30, 200.0)]
    room = Room(max_size=100, min_free=0)
    assert room.plan(files, 10, free=1000, disk_total=2000) == []
    assert room.plan(files, 20, free=1000, disk_total=2000) == [Path("old")]
    assert room.plan(files, 50, free=1000, disk_total=2000) == [Path("old"), Path("mid")]
    assert room.plan(files, 101, free=1000, disk_total=2000) is None  # not even alone
    on_disk = Room(max_size=None, min_free=0.1)  # 10 % of 2000: 200 bytes stay free
    assert on_disk.plan(files, 40, free=230, disk_total=2000) == [Path("old")]
    assert on_disk.plan(files, 40, free=240, disk_total=2000) == []
    assert on_disk.plan(files, 200, free=100, disk_total=2000) is None


def test_a_full_cache_drops_its_least_recently_used_file_and_a_hit_counts_as_a_use(small, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    _load(small, cache, "int8")
    _load(small, cache, "int8-group")
    first = _files(cache)
    assert set(first) == {"int8", "int8-group"}
    size = max(p.stat().st_size for p in first.values())
    _age(first["int8"], 20)
    _age(first["int8-group"], 10)  # int8 the oldest ...
    assert _load(small, cache, "int8").cache_hit  # ... until this hit
    monkeypatch.setenv(MAX_SIZE_ENV, str(int(2.5 * size)))  # room for two files
    llm = _load(small, cache, "none")
    assert not llm.cache_hit
    after = _files(cache)
    assert len(after) == 2 and "int8-group" not in after and after["int8"] == first["int8"]  # int8-group went
    assert sum(p.stat().st_size for p in after.values()) <= 2.5 * size
    assert _load(small, cache, "none").cache_hit


def test_a_file_that_cannot_fit_is_not_written_and_the_load_goes_on(small, tmp_path, monkeypatch, caplog):
    cache = tmp_path / "cache"
    _load(small, cache, "int8")
    (kept,) = _files(cache).values()
    free = shutil.disk_usage(tmp_path).free
    monkeypatch.setenv(MIN_FREE_ENV, str(free + GIB))  # more than the disk has: nothing fits
    with caplog.at_level(logging.WARNING, logger="quill.prepacked"):
        llm = _load(small, cache, "int8-group")
    assert "not writing" in caplog.text and MIN_FREE_ENV in caplog.text
    assert list(_files(cache).values()) == [kept]  # nothing deleted for a file that does not fit
    plain = quill.LLM(str(small), threads=2, progress=False, cache=False, activation_quant="int8-group",
                      skip_tokenizer_init=True)
    assert llm.generate(PROMPT, GREEDY)[0].token_ids == plain.generate(PROMPT, GREEDY)[0].token_ids


def test_a_file_deleted_while_it_is_read_is_rebuilt(small, tmp_path, monkeypatch):
    """Another process may make room (or clear the cache) between this one's header read and its map."""
    import quill.prepacked.file as prepacked_file
    cache = tmp_path / "cache"
    _load(small, cache, "int8")
    real = prepacked_file.map_data

    def deleted_first(path, header):
        path.unlink()
        return real(path, header)

    monkeypatch.setattr(prepacked_file, "map_data", deleted_first)
    llm = _load(small, cache, "int8")
    assert not llm.cache_hit and len(_files(cache)) == 1  # loaded from the checkpoint, written again
    monkeypatch.setattr(prepacked_file, "map_data", real)
    again = _load(small, cache, "int8")
    assert again.cache_hit
    assert again.generate(PROMPT, GREEDY)[0].token_ids == llm.generate(PROMPT, GREEDY)[0].token_ids


def test_a_bad_limit_is_refused_before_the_load(small, tmp_path, monkeypatch):
    monkeypatch.setenv(MAX_SIZE_ENV, "a lot")
    with pytest.raises(ConfigError, match=f"{MAX_SIZE_ENV}='a lot': expected a size"):
        quill.LLM(str(small), threads=2, progress=False, cache=True, cache_dir=tmp_path, skip_tokenizer_init=True)


def test_quill_cache_list_shows_the_limits(tmp_path, monkeypatch):
    monkeypatch.setenv(MAX_SIZE_ENV, "40G")
    out, torch_loaded = imported_torch(["cache", "list", "--cache-dir", str(tmp_path)])
    assert f"at most 42.9 GB ({MAX_SIZE_ENV})" in out and f"({MIN_FREE_ENV})" in out and not torch_loaded
