"""The prepacked cache checks every byte it uses: a flipped byte anywhere in a file (header or data) is
refused, the file deleted with a warning naming it and rebuilt from the checkpoint; leftovers of killed
writers are listed by `quill cache list` and cleaned (`quill cache prune`, the next write)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from quill.default_model import default_model_path
from quill.prepacked.header import read_header
from quill.prepacked.store import SUFFIX, PrepackedCache
from tests.test_prepacked import _answer, _files, _flip, _load


def test_every_byte_of_a_small_file_is_under_a_checksum(tmp_path):
    """Each byte of the length prefix, header (facts, tokenizer, tensor entries, padding) and data flipped in
    turn: read_header or the data check refuses the file, whatever the byte held."""
    import torch

    from quill.errors import CacheError
    from quill.prepacked.file import map_data, write_file
    path = tmp_path / "small.safetensors"
    tensors = {"a:codes": torch.arange(40, dtype=torch.uint8), "b:scales": torch.linspace(-1, 1, 6)}
    facts = {"config": {"rope_theta": 10000.0, "rms_norm_eps": 1e-5}, "records": {"a": 1}}
    write_file(path, tensors, {"tokenizer": '{"model": {"vocab": {"a": 0}}}'}, facts)
    header = read_header(path)
    assert header.facts["config"]["rope_theta"] == 10000.0
    assert header.data_start > 100 and header.data_len == 40 + 24
    whole = path.read_bytes()
    for at in range(len(whole)):
        for mask in (0x01, 0x80):
            _flip(path, at, mask)
            with pytest.raises(CacheError, match="checksum|truncated|corrupt"):
                map_data(path, read_header(path)).tensors
            _flip(path, at, mask)
    assert path.read_bytes() == whole
    got = map_data(path, read_header(path)).tensors
    assert all(torch.equal(got[k], t) for k, t in tensors.items())


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> tuple[Path, tuple]:
    """A cache directory holding the default model's file, and the model's answer."""
    cache = tmp_path_factory.mktemp("built")
    return cache, _answer(_load(default_model_path(), cache))


def _region(path: Path, region: str) -> int:
    """The offset of a byte in ``region`` of a cache file's header."""
    header = read_header(path)
    raw = path.read_bytes()[:header.data_start]
    text = raw[8:].decode()
    if region == "length prefix":
        return 1
    if region == "header checksum":
        return 8 + text.index("header_checksum") + len('header_checksum":"') + 5
    if region in ("rope_theta", "rms_norm_eps"):  # a digit of the value in the saved config (JSON in JSON)
        at = text.index(f'\\"{region}\\":') + len(f'\\"{region}\\":')
        return 8 + next(i for i in range(at, at + 40) if text[i].isdigit())
    if region == "tokenizer":
        return 8 + text.index('"tokenizer":') + 5000
    if region == "data checksum":
        return 8 + text.index('\\"checksum\\":\\"') + 20
    if region == "tensor entry":
        return 8 + text.index('"data_offsets":[') + len('"data_offsets":[') + 1
    assert region == "padding"
    return header.data_start - 1  # a space of the padding (or, with none needed, the closing brace)


def _copied(source: Path, tmp_path: Path) -> tuple[PrepackedCache, Path]:
    cache = tmp_path / "cache"
    shutil.copytree(source, cache)
    (path,) = _files(cache)
    return PrepackedCache(cache), path


def _key_of(path: Path):
    """The key a load asks the cache for to find ``path``."""
    from quill.prepacked.store import CacheKey
    facts = read_header(path).facts
    key = CacheKey(facts["digest"], json.dumps(facts["key"], sort_keys=True))
    assert path.name == key.name + SUFFIX
    return key


@pytest.mark.parametrize("region", ["length prefix", "header checksum", "rope_theta", "rms_norm_eps", "tokenizer",
                                    "data checksum", "tensor entry", "padding"])
def test_a_flipped_header_byte_is_refused_and_the_file_deleted(region, built_cache, tmp_path, caplog):
    """One byte of each region of the default model's header, opened as a load opens it: a miss, and the file
    is deleted with a warning naming it and the failed check (so the load rebuilds it)."""
    cache, path = _copied(built_cache[0], tmp_path)
    key = _key_of(path)
    cache.open(key).settle()  # whole, it opens
    _flip(path, _region(path, region))
    with caplog.at_level("WARNING", logger="quill.prepacked"):
        assert cache.open(key) is None
    assert f"deleted {path}, unusable: " in caplog.text and "rebuilding it from the checkpoint" in caplog.text
    assert re.search(r"header's checksum differs|truncated or corrupt|does not begin with", caplog.text)
    assert not path.exists()


def test_a_changed_rope_theta_is_rebuilt_from_the_checkpoint(built_cache, tmp_path, caplog):
    """The reported case: a digit of the stored rope_theta changed once gave another answer, silently."""
    source, want = built_cache
    cache, path = _copied(source, tmp_path)
    _flip(path, _region(path, "rope_theta"))
    with caplog.at_level("WARNING", logger="quill.prepacked"):
        llm = _load(default_model_path(), cache.directory)
    assert not llm.cache_hit and f"deleted {path}, unusable: corrupt: the header's checksum differs" in caplog.text
    assert _answer(llm) == want
    assert read_header(path).facts["config"] == read_header(source / "prepacked" / path.name).facts["config"]


def test_flipped_bytes_across_the_default_model_header_are_all_refused(built_cache, tmp_path):
    """The first and last 2 KiB of the real header byte by byte, and every 4099th byte between."""
    from quill.errors import CacheError
    (src,) = _files(built_cache[0])
    path = tmp_path / src.name
    shutil.copyfile(src, path)
    end = read_header(path).data_start
    spots = sorted({*range(2048), *range(end - 2048, end), *range(2048, end, 4099)})
    for at in spots:
        _flip(path, at)
        with pytest.raises(CacheError):
            read_header(path)
        _flip(path, at)
    read_header(path)


LEFT_BY_A_KILLED_WRITER = """
import os, sys, time
from pathlib import Path
import torch
from quill.prepacked import file
def hold(src, dst):  # the whole file is written: stop before the rename and wait to be killed
    print(src, flush=True)
    time.sleep(600)
file.os.replace = hold
file.write_file(Path(sys.argv[1]), {"w": torch.arange(1 << 20, dtype=torch.int32)}, {}, {"source": "killed"})
"""


def _killed_writer_leftover(cache: Path) -> Path:
    """SIGKILL a process writing a cache file in ``cache``; the temporary file it leaves."""
    (cache / "prepacked").mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([sys.executable, "-c", LEFT_BY_A_KILLED_WRITER, str(cache / "prepacked" / f"x{SUFFIX}")],
                            stdout=subprocess.PIPE, text=True)
    tmp = Path(proc.stdout.readline().strip())
    proc.kill()
    proc.wait(60)
    proc.stdout.close()
    assert tmp.is_file() and tmp.name.startswith(f".x{SUFFIX}.{proc.pid}.") and tmp.stat().st_size > 4 << 20
    return tmp


def test_leftovers_of_killed_writers_are_listed_and_cleaned(tmp_path, capsys):
    from quill.cli import main
    cache = tmp_path / "cache"
    dead = _killed_writer_leftover(cache)
    live = cache / "prepacked" / f".y{SUFFIX}.{os.getpid()}.0123abcd.tmp"  # this process: a writer at work
    live.write_bytes(b"\0" * 1000)
    idle = cache / "sources" / f".z.json.{os.getpid()}.tmp"  # a digest record's, untouched for an hour
    idle.parent.mkdir()
    idle.write_text("{}")
    os.utime(idle, (idle.stat().st_mtime - 3600,) * 2)

    assert main(["cache", "list", "--cache-dir", str(cache)]) == 0
    out = capsys.readouterr().out
    assert "0 file(s)" in out and "leftovers: 3 temporary file(s), 4.2 MB (2 of writers that stopped" in out
    assert re.search(rf"prepacked/{re.escape(dead.name)} +4\.2 MB  pid \d+: writer gone", out), out
    assert re.search(rf"prepacked/{re.escape(live.name)} +0\.0 MB  pid {os.getpid()}: being written", out), out
    assert "untouched for 60 min" in out

    assert main(["cache", "prune", "--cache-dir", str(cache)]) == 0
    assert f"removed prepacked/{dead.name}" in capsys.readouterr().out
    assert not dead.exists() and not idle.exists() and live.exists()

    again = _killed_writer_leftover(cache)  # and a load that writes a file removes what killed writers left
    _load(default_model_path(), cache)
    assert not again.exists() and live.exists() and len(_files(cache)) == 1


def test_prune_removes_unusable_files_and_keeps_good_ones(built_cache, tmp_path, capsys):
    from quill.cli import main
    cache = tmp_path / "cache"
    shutil.copytree(built_cache[0], cache)
    (good,) = _files(cache)
    bad = cache / "prepacked" / f"{'0' * 32}{SUFFIX}"
    shutil.copyfile(good, bad)
    _flip(bad, 100)
    assert main(["cache", "list", "--cache-dir", str(cache)]) == 0
    assert "UNUSABLE (corrupt: the header's checksum differs" in capsys.readouterr().out
    assert main(["cache", "prune", "--cache-dir", str(cache)]) == 0
    assert _files(cache) == [good] and read_header(good)
