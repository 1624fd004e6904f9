"""The native build's plan (which ISA variants, which translation units) and its staleness rules; the variants
the extension holds (the backend table, csrc/isa.h); an ISA this build cannot run is a KernelError."""

import os
from pathlib import Path

import pytest

from quill import native
from quill.errors import KernelError
from quill.native import build
from quill.platform import Platform, detect, parse_cpuinfo

DATA = Path(__file__).parent / "data" / "cpuinfo"
AVX512_LACKS = "this CPU lacks avx512f, avx512bw, avx512vl, avx512_vnni"


def test_variant_status_follows_the_cpu():
    zen3 = parse_cpuinfo((DATA / "zen3_epyc7763_1s8c16t.txt").read_text())
    assert native.variant_status(zen3) == {"avx512": AVX512_LACKS, "avx2": None, "scalar": None}
    zen4 = parse_cpuinfo((DATA / "zen4_epyc9654_2s4c16t.txt").read_text())
    assert native.variant_status(zen4) == {"avx512": None, "avx2": None, "scalar": None}  # --isa avx2 keeps working
    assert native.variant_status(Platform()) == {"avx512": AVX512_LACKS, "avx2": "this CPU lacks avx2, fma, f16c",
                                                 "scalar": None}


def test_sources_hold_the_variants_asked_for_and_the_scalar_twins():
    avx2 = build.sources(["avx2"])
    assert {"avx2.cpp", "dense_avx2.cpp", "attention_avx2.cpp"} <= set(avx2)
    assert {"scalar.cpp", "dense_scalar.cpp", "attention_scalar.cpp"} <= set(avx2)
    assert not any("avx512" in name for name in avx2)
    assert avx2["backends.cpp"] == ["-DQUILL_BUILT_AVX2"] and avx2["avx2.cpp"] == build.AVX2
    both = build.sources(["avx512", "avx2"])
    assert both["backends.cpp"] == ["-DQUILL_BUILT_AVX512", "-DQUILL_BUILT_AVX2"]
    assert "-mavx512vnni" in both["avx512_vnni.cpp"]
    scalar = build.sources([])
    assert scalar["backends.cpp"] == [] and "scalar.cpp" in scalar and "avx2.cpp" not in scalar
    assert build.GLUE in scalar and not set(build.TORCH_SOURCES) & set(scalar)  # one TU includes them all


def test_the_torch_sources_are_one_translation_unit(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "BUILD", tmp_path)
    glue = build._glue()
    lines = glue.read_text().splitlines()[1:]
    assert lines == [f'#include "{build.CSRC / name}"' for name in build.TORCH_SOURCES]
    stamp = glue.stat().st_mtime_ns
    assert build._glue().stat().st_mtime_ns == stamp  # unchanged list: not rewritten, so nothing recompiles


def test_unknown_variant_is_refused(capsys):
    with pytest.raises(SystemExit):
        build.main(["--variants", "avx2,sse9"])
    assert "unknown variant(s) sse9; known: avx512, avx2, scalar" in capsys.readouterr().err


def test_an_object_is_stale_only_when_its_inputs_or_command_change(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "BUILD", tmp_path)
    src, used, unused, obj = (tmp_path / n for n in ("a.cpp", "used.h", "unused.h", "a.o"))
    for p in (src, used, unused):
        p.write_text("//")
    cmd = ["g++", "-c", str(src), "-o", str(obj)]
    assert build._stale(cmd, obj, [src])  # never built
    obj.write_text("obj")
    build._stamp(obj).write_text(" ".join(cmd))
    obj.with_suffix(".d").write_text(f"{obj}: {src} \\\n {used}\n")  # what g++ -MMD writes
    old = obj.stat().st_mtime - 10
    for p in (src, used, unused):
        os.utime(p, (old, old))
    inputs = [src, *build._includes(obj, [used, unused])]
    assert inputs == [src, used]
    assert not build._stale(cmd, obj, inputs)
    assert build._stale([*cmd, "-O2"], obj, inputs)  # other flags
    os.utime(unused, None)  # a header the TU does not include: nothing to do
    assert not build._stale(cmd, obj, [src, *build._includes(obj, [used, unused])])
    os.utime(used, None)
    assert build._stale(cmd, obj, [src, *build._includes(obj, [used, unused])])


def test_the_extension_holds_the_variants_this_cpu_runs():
    if native.load().module is None:
        pytest.skip(native.load().error)
    import torch

    here = [name for name, why in native.variant_status(detect()).items() if why is None]
    assert list(native.built_variants()) == here  # what python -m quill.native.build compiles by default
    for name in ("avx512", "avx2"):
        if name not in native.built_variants():
            with pytest.raises(KernelError, match=f"decode_attention: ISA '{name}' needs .*, which this CPU lacks"):
                native.load().module.decode_attention(torch.zeros(1, 1, 1, 8), torch.zeros(1, 1, 2, 8),
                                                      torch.zeros(1, 1, 2, 8), None, 1.0, name)


def test_best_builds_this_cpus_best_variant_and_keeps_the_others_already_built(tmp_path, monkeypatch):
    monkeypatch.setattr(build, "BUILD", tmp_path)
    monkeypatch.setattr(build, "native_variants", lambda: ["avx512", "avx2"])  # an AVX-512 host
    assert build.best_variants() == ["avx512"]  # make demo: no AVX2 kernels to compile
    for name in build.VARIANT_SOURCES["avx2"]:
        (tmp_path / (Path(name).stem + ".o")).write_text("obj")
    assert build.best_variants() == ["avx512", "avx2"]  # after a full build: not dropped from the link
    monkeypatch.setattr(build, "native_variants", lambda: [])  # no AVX2: the scalar twins alone
    assert build.best_variants() == []


def test_a_variant_not_built_is_why_the_native_kernels_refuse(monkeypatch):
    if native.load().module is None:
        pytest.skip(native.load().error)
    from quill.kernels.dense import NativeDenseKernel
    from quill.kernels.native import NativeW4A8Kernel

    zen4 = parse_cpuinfo((DATA / "zen4_epyc9654_2s4c16t.txt").read_text())
    monkeypatch.setattr(native, "built_variants", lambda: ("avx512", "scalar"))  # make demo's build
    assert native.unsupported(zen4) is None and NativeW4A8Kernel.supported(zen4) is None
    why = native.unsupported(zen4.limited_to("avx2"))  # --isa avx2
    assert why == ("the avx2 kernels are not built into this install (built: avx512, scalar); `make native` "
                   "(python -m quill.native.build) builds every variant this CPU runs")
    assert NativeW4A8Kernel.supported(zen4.limited_to("avx2")) == why
    assert NativeDenseKernel.supported(zen4.limited_to("avx2")) == why
