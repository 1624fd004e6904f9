"""docs/BENCHMARKS.md is what ``python -m quill.bench.page`` makes of the committed JSON, and says what it lacks."""

import json
import re

import pytest

from quill.bench import page
from quill.bench.meta import git_commit, run_metadata
from quill.errors import ConfigError
from quill.platform import detect


def test_committed_page_is_generated_from_committed_json(capsys):
    assert page.main(["--check"]) == 0, capsys.readouterr().err
    assert len(page.PAGE.read_text().splitlines()) <= 200


def test_page_links_resolve():
    text = page.PAGE.read_text()
    docs = page.PAGE.parent
    for target in re.findall(r"\]\(([^)#]+)(?:#([^)]*))?\)", text):
        path, frag = target
        if path.startswith("http"):
            continue
        assert (docs / path).exists(), f"docs/BENCHMARKS.md links to {path}, which does not exist"
        if frag:  # a notebook section: its heading must still exist
            headings = [h.lstrip("#").strip() for h in (docs / path).read_text().splitlines() if h.startswith("#")]
            assert frag in {page.anchor(h) for h in headings}, f"no heading in {path} has the anchor #{frag}"


def write(d, name, data):
    (d / name).parent.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(json.dumps(data))


def result(file, w4a16, w4a8g, llama, probes=(40.0, 52.4)):
    med = {"quill w4a16": {"decode_tps": w4a16[0], "prefill_tps": w4a16[1]},
           "llama.cpp": {"decode_tps": llama[0], "prefill_tps": llama[1]}}
    if w4a8g:
        med["quill w4a8g"] = {"decode_tps": w4a8g[0], "prefill_tps": w4a8g[1]}
    return {"file": file, "prompt": 128, "gen": 64, "threads": 2, "median": med, "runs": {"dram_gbs": list(probes)}}


@pytest.fixture
def bench_dir(tmp_path):
    meta = {"cpu": "AMD EPYC 9999 (AMD zen9, 2 cores / 2 threads, avx512_vnni)", "cpu_family": "AMD family 26 model 2",
            "cores": 2, "threads": 2, "date": "2026-12-01 10:00 UTC", "commit": "abcdef123456", "torch": "2.13.0+cpu",
            "llama_cpp": "llama-cpp-python 0.3.36"}
    write(tmp_path, "m/new.json", {"meta": meta, "results": [result("/x/a.gguf", (60, 200), (80, 400), (50, 250))]})
    write(tmp_path, "m/old.json", [result("/x/a.gguf", (30, 90), None, (20, 100)),
                                   result("/x/b.gguf", (10, 30), None, (20, 60))])
    write(tmp_path, "page.json", {"plot": "p.png", "machines": [{
        "title": "Test CPU", "notebook": "A section", "note": "Note.",
        "llamacpp": [{"model": "A", "isa": "AVX-512", "file": "m/new.json"},
                     {"model": "A old", "isa": "AVX2", "file": "m/old.json", "gguf": "a.gguf"},
                     {"model": "8B", "isa": "AVX2", "file": None}]}]})
    return tmp_path


def test_page_shows_recorded_fields_and_dashes_for_the_rest(bench_dir):
    text = page.render(bench_dir)
    row = next(line for line in text.splitlines() if line.startswith("| A | AVX-512"))
    assert "80.0 (1.60x) / 400 (1.60x)" in row and "60.0 (1.20x) / 200 (0.80x)" in row and "50.0 / 250" in row
    assert "| 52 |" in row  # the best probe of the run
    old = next(line for line in text.splitlines() if line.startswith("| A old | AVX2"))
    assert "| — | 30.0 (1.50x) / 90 (0.90x) |" in old  # int8-group not measured there
    assert "| 8B | AVX2 | — | not measured |" in text
    machine = next(line for line in text.splitlines() if "AMD EPYC 9999" in line)
    assert "abcdef123456" in machine and "2026-12-01 10:00 UTC" in machine and "llama-cpp-python 0.3.36" in machine
    # the old file records only its thread count: every other field is the new file's alone
    assert "recorded by m/new.json only" in text


def test_an_ik_llama_cpp_peer_gets_its_own_column_with_quills_ratio(bench_dir):
    data = json.loads((bench_dir / "m/new.json").read_text())
    data["results"][0]["median"]["ik_llama.cpp 8337e4c"] = {"decode_tps": 64.0, "prefill_tps": 500.0}
    write(bench_dir, "m/new.json", data)
    lines = page.render(bench_dir).splitlines()
    assert any("| llama.cpp | ik_llama.cpp (-rtr 1), quill int8-group's ratio |" in line for line in lines)
    row = next(line for line in lines if line.startswith("| A | AVX-512"))
    assert "| 64.0 / 500 (quill 1.25x / 0.80x) |" in row  # quill int8-group 80 / 400 against ik's 64 / 500
    old = next(line for line in lines if line.startswith("| A old | AVX2"))
    assert "| 20.0 / 100 | — |" in old  # no ik run beside that one
    data["results"][0]["median"]["ik_llama.cpp other"] = {"decode_tps": 1.0, "prefill_tps": 1.0}
    write(bench_dir, "m/new.json", data)
    with pytest.raises(ConfigError, match="more than one ik_llama.cpp peer"):
        page.render(bench_dir)


def test_page_refuses_a_missing_file_or_an_ambiguous_one(bench_dir):
    manifest = json.loads((bench_dir / "page.json").read_text())
    manifest["machines"][0]["llamacpp"][1].pop("gguf")
    write(bench_dir, "page.json", manifest)
    with pytest.raises(ConfigError, match=r"m/old.json: expected one result for gguf=None, found 2 .*a.gguf, b.gguf"):
        page.render(bench_dir)
    manifest["machines"][0]["llamacpp"][1]["file"] = "m/nope.json"
    write(bench_dir, "page.json", manifest)
    with pytest.raises(ConfigError, match="names m/nope.json"):
        page.render(bench_dir)


def test_plot_writes_a_png(bench_dir):
    pytest.importorskip("matplotlib")
    _, machines = page.read_all(bench_dir)
    page.plot(machines, bench_dir / "p.png")
    assert (bench_dir / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_run_metadata_names_this_machine_and_checkout():
    platform = detect()
    meta = run_metadata(platform, 2)
    assert meta["cpu"] == platform.summary() and meta["cores"] == platform.physical_cores and meta["threads"] == 2
    assert meta["torch"].startswith("2.") and re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d UTC", meta["date"])
    assert meta["commit"] == git_commit() and re.match(r"[0-9a-f]{12}(\+dirty)?$", meta["commit"])
    assert meta["llama_cpp"] is None  # no peer named
