"""``quill info`` for recorded CPUs: platform lines and every kernel's availability."""

from pathlib import Path

import pytest

from quill.cli import main
from quill.cli.info import report
from quill.kernels.selection import KERNELS, PRIORITIES
from quill.platform import Platform, detect, parse_cpuinfo

DATA = Path(__file__).parent / "data" / "cpuinfo"


def recorded(name: str) -> Platform:
    caches = (("L1d", 32768), ("L2", 524288), ("L3", 33554432))
    return parse_cpuinfo((DATA / name).read_text(), cache_bytes=caches,
                         cache_shared_cpus=(("L1d", 2), ("L2", 2), ("L3", 16)))


def kernel_lines(text: str) -> dict[str, str]:
    return {line.split()[0]: line.split(None, 1)[1] for line in text.splitlines() if line.startswith("  ")}


def test_zen3_report():
    text = report(recorded("zen3_epyc7763_1s8c16t.txt"))
    lines = text.splitlines()
    assert lines[0] == "cpu:        AMD EPYC 7763 64-Core Processor (AMD, zen3, family 25 model 1, stepping 1)"
    assert lines[1] == "cores:      8 physical, 16 logical, 1 socket(s), 2 thread(s) per core"
    assert lines[2] == ("caches:     L1d 32 KiB (shared by 2 CPUs), L2 512 KiB (shared by 2 CPUs), "
                        "L3 32768 KiB (shared by 16 CPUs)")
    assert lines[3] == "isa flags:  avx2 fma f16c"
    assert lines[4] == "isa level:  avx2"
    assert lines[5] == "kernels (tried in this order on avx2; each layer runs on the first that accepts it):"
    kernels = kernel_lines(text)
    assert list(kernels)[:len(PRIORITIES["avx2"])] == list(PRIORITIES["avx2"])
    assert kernels["zentorch"].startswith("unavailable: zentorch needs AVX-512")
    assert kernels["zentorch"].endswith(
        "this zen3 CPU lacks avx512f, avx512bw, avx512vl, avx512dq, avx512_vnni, avx512_bf16")
    assert kernels["torch"] == "available" and kernels["reference"] == "available"
    assert set(kernels) == set(KERNELS)


def test_sapphire_rapids_report():
    text = report(recorded("spr_xeon8480_2s4c16t.txt"))
    assert "(Intel, sapphire_rapids, family 6 model 143, stepping 8)" in text
    assert "cores:      8 physical, 16 logical, 2 socket(s), 2 thread(s) per core" in text
    assert ("isa flags:  avx2 fma f16c avx512f avx512bw avx512vl avx512dq avx512_vnni avx512_bf16 avx_vnni "
            "amx_tile amx_int8 amx_bf16") in text
    assert "isa level:  amx" in text
    zentorch = "unavailable: zentorch runs on AMD Zen CPUs only; this is Intel sapphire_rapids"
    assert kernel_lines(text)["zentorch"] == zentorch and kernel_lines(text)["zentorch_woq"] == zentorch


def test_zen4_report():
    text = report(recorded("zen4_epyc9654_2s4c16t.txt"))
    assert "isa level:  avx512_vnni" in text
    assert "avx512_vnni avx512_bf16" in text and "amx" not in text.split("isa level")[0]
    # zentorch's line depends on this host (installed? a Zen with AVX-512?); it is always one of two things
    line = kernel_lines(text)["zentorch"]
    assert line == "available" or line.startswith("unavailable: zentorch")


def test_unknown_cpu_report():
    text = report(Platform())
    assert "cpu:        unknown (unknown, unknown)" in text
    assert "caches:     unknown" in text
    assert "isa flags:  none of avx2" in text and "isa level:  scalar" in text


_LATE_KERNELS = '''
from quill.kernels.reference import ReferenceKernel

class NeedsAmx(ReferenceKernel):
    name = "late_amx"

    @classmethod
    def supported(cls, platform):
        missing = platform.missing("amx_tile", "amx_int8")
        return f"needs AMX; this CPU lacks {', '.join(missing)}" if missing else None
'''


def test_kernels_registered_later_are_listed(tmp_path, monkeypatch):
    (tmp_path / "quill_test_late.py").write_text(_LATE_KERNELS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(KERNELS, "late_amx", "quill_test_late:NeedsAmx")
    monkeypatch.setitem(KERNELS, "late_broken", "quill_test_no_such_module:Kernel")  # e.g. an unbuilt extension
    monkeypatch.setitem(PRIORITIES, "amx", ("late_amx",) + PRIORITIES["avx2"])  # a row of its own for AMX

    zen3 = report(recorded("zen3_epyc7763_1s8c16t.txt"))
    assert "other registered kernels (used only when forced with QUILL_KERNEL):" in zen3
    kernels = kernel_lines(zen3)
    assert kernels["late_amx"] == "unavailable: needs AMX; this CPU lacks amx_tile, amx_int8"
    assert kernels["late_broken"].startswith("unavailable: cannot be loaded: ModuleNotFoundError")

    spr = report(recorded("spr_xeon8480_2s4c16t.txt"))
    assert list(kernel_lines(spr))[0] == "late_amx" and kernel_lines(spr)["late_amx"] == "available"


def test_cli_with_recorded_cpuinfo(capsys):
    assert main(["info", "--cpuinfo", str(DATA / "zen3_epyc7763_notopology4.txt")]) == 0
    out = capsys.readouterr().out
    assert "cores:      4 physical, 4 logical, 1 socket(s), 1 thread(s) per core" in out
    assert "isa level:  avx2" in out


def test_cli_on_this_machine(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("cpu:") and "isa level:" in out and "  reference      available" in out


def test_native_variants_listed_with_why_the_others_were_not_built():
    from quill import native
    from quill.cli.info import native_report

    if native.load().module is None:
        assert native_report(detect()).startswith("native variants: none (extension not built")
        return
    lines = native_report(recorded("zen3_epyc7763_1s8c16t.txt")).splitlines()
    assert lines[0].startswith("native variants (built into _quill_native")
    built = set(native.built_variants())
    assert "scalar" in built and "  scalar: built" in lines
    if "avx512" not in built:  # what an AVX2-only build host prints
        assert ("  avx512: not built: this CPU lacks avx512f, avx512bw, avx512vl, avx512_vnni") in lines
    # a variant this CPU runs but the build lacks (a --variants build) says how to get it
    if "avx2" not in built:
        assert "  avx2: not built: this CPU runs it; rebuild: python -m quill.native.build" in lines


def test_cli_on_this_machine_lists_native_variants(capsys):
    assert main(["info"]) == 0
    assert "\nnative variants" in capsys.readouterr().out


def test_cli_unreadable_cpuinfo(tmp_path, capsys):
    assert main(["info", "--cpuinfo", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err
    assert "quill: error: --cpuinfo" in err and "cannot read it" in err


@pytest.mark.parametrize("name", sorted(p.name for p in DATA.glob("*.txt")))
def test_every_recorded_cpu_reports(name):
    text = report(parse_cpuinfo((DATA / name).read_text()))
    assert set(kernel_lines(text)) == set(KERNELS)


def test_a_closed_stdout_ends_quietly():
    """``quill info | head``: the reader leaves before quill is done writing; quill stops with the shell's
    SIGPIPE status and no traceback."""
    import subprocess
    import sys

    p = subprocess.Popen([sys.executable, "-m", "quill", "info"], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    p.stdout.close()  # before quill writes its first line
    err = p.stderr.read()
    assert p.wait(timeout=300) == 141, err.decode()
    assert b"Traceback" not in err and b"BrokenPipe" not in err, err.decode()
