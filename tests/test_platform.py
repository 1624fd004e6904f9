"""Platform detection from recorded /proc/cpuinfo texts and a fake sysfs tree."""

import logging
from dataclasses import replace
from pathlib import Path

import pytest

from quill.platform import Platform, detect, microarch_of, parse_cpuinfo, read_sysfs_caches, read_sysfs_cores

DATA = Path(__file__).parent / "data" / "cpuinfo"


def cpuinfo(name: str) -> str:
    return (DATA / name).read_text()


# file -> (vendor, microarch, family, model, isa_level, physical, logical, sockets, model name prefix)
RECORDED = {
    "zen3_epyc7763_1s8c16t.txt": ("AMD", "zen3", 25, 1, "avx2", 8, 16, 1, "AMD EPYC 7763"),
    "zen4_epyc9654_2s4c16t.txt": ("AMD", "zen4", 25, 17, "avx512_vnni", 8, 16, 2, "AMD EPYC 9654"),
    "zen4_epyc_genoa_vm2.txt": ("AMD", "zen4", 25, 17, "avx512_vnni", 2, 2, 1, "AMD EPYC"),
    "spr_xeon8480_2s4c16t.txt": ("Intel", "sapphire_rapids", 6, 143, "amx", 8, 16, 2, "Intel(R) Xeon(R) Platinum"),
    "zen3_epyc7763_notopology4.txt": ("AMD", "zen3", 25, 1, "avx2", 4, 4, 1, "AMD EPYC 7763"),
}


@pytest.mark.parametrize("name", sorted(RECORDED))
def test_recorded_cpus(name):
    vendor, arch, family, model, level, phys, logical, sockets, model_name = RECORDED[name]
    p = parse_cpuinfo(cpuinfo(name))
    assert (p.vendor, p.microarch, p.family, p.model) == (vendor, arch, family, model)
    assert p.isa_level == level
    assert (p.physical_cores, p.logical_cpus, p.sockets) == (phys, logical, sockets)
    assert p.model_name.startswith(model_name)
    assert p.threads_per_core == logical // phys


def test_zen3_flags_have_no_avx512():
    p = parse_cpuinfo(cpuinfo("zen3_epyc7763_1s8c16t.txt"))
    assert p.has("avx2", "fma", "f16c") and p.is_zen
    assert p.missing("avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni") == (
        "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni")
    assert not any(f.startswith("amx") for f in p.flags)


def test_zen4_flags():
    p = parse_cpuinfo(cpuinfo("zen4_epyc9654_2s4c16t.txt"))
    assert p.has("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx512_bf16")
    assert p.missing("avx_vnni", "amx_tile", "amx_int8", "amx_bf16") == ("avx_vnni", "amx_tile", "amx_int8", "amx_bf16")
    assert p.is_zen and p.stepping == 1


def test_sapphire_rapids_flags():
    p = parse_cpuinfo(cpuinfo("spr_xeon8480_2s4c16t.txt"))
    assert p.has("avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx_vnni",
                 "amx_tile", "amx_int8", "amx_bf16")
    assert not p.is_zen and p.stepping == 8


def test_smt_siblings_and_sockets_counted_once():
    # core ids restart in every socket: counting unique core ids alone would give 4, not 8
    text = cpuinfo("spr_xeon8480_2s4c16t.txt")
    core_ids = {line.split(":")[1].strip() for line in text.splitlines() if line.startswith("core id")}
    assert core_ids == {"0", "1", "2", "3"}
    assert parse_cpuinfo(text).physical_cores == 8


def _strip(text: str, *keys: str) -> str:
    return "\n".join(line for line in text.splitlines() if line.split("\t")[0].strip() not in keys) + "\n"


def test_cpu_cores_field_when_core_ids_are_missing():
    text = _strip(cpuinfo("zen4_epyc9654_2s4c16t.txt"), "core id")
    p = parse_cpuinfo(text)
    assert (p.physical_cores, p.logical_cpus, p.sockets) == (8, 16, 2)  # "cpu cores" 4 x 2 sockets


def test_no_topology_uses_sysfs_count_or_logical():
    text = cpuinfo("zen3_epyc7763_notopology4.txt")
    assert parse_cpuinfo(text).physical_cores == 4
    assert parse_cpuinfo(text, topology_cores=2).physical_cores == 2
    # topology in cpuinfo wins over the sysfs count
    assert parse_cpuinfo(cpuinfo("zen3_epyc7763_1s8c16t.txt"), topology_cores=3).physical_cores == 8


def test_empty_and_foreign_text():
    p = parse_cpuinfo("")
    assert (p.vendor, p.microarch, p.isa_level) == ("unknown", "unknown", "scalar")
    assert (p.physical_cores, p.logical_cpus) == (1, 1)
    arm = "processor\t: 0\nBogoMIPS\t: 50.00\nFeatures\t: fp asimd\nCPU implementer\t: 0x41\n\n"
    p = parse_cpuinfo(arm)
    assert (p.vendor, p.isa_level, p.logical_cpus) == ("unknown", "scalar", 1)


@pytest.mark.parametrize("family,model,arch", [
    (23, 1, "zen"), (23, 8, "zen"), (23, 49, "zen2"), (23, 113, "zen2"), (23, 160, "zen2"),
    (25, 1, "zen3"), (25, 8, "zen3"), (25, 33, "zen3"), (25, 68, "zen3"), (25, 80, "zen3"),
    (25, 17, "zen4"), (25, 24, "zen4"), (25, 97, "zen4"), (25, 116, "zen4"), (25, 160, "zen4"),
    (26, 2, "zen5"), (26, 17, "zen5"), (26, 68, "zen5"), (21, 2, "unknown"),
])
def test_amd_generations(family, model, arch):
    assert microarch_of("AMD", family, model) == arch


@pytest.mark.parametrize("model,stepping,flags,arch", [
    (143, 8, set(), "sapphire_rapids"), (207, 2, set(), "emerald_rapids"), (173, 1, set(), "granite_rapids"),
    (106, 6, set(), "ice_lake_server"), (85, 4, set(), "skylake_server"), (85, 7, set(), "cascade_lake"),
    (85, 11, set(), "cooper_lake"), (151, 2, set(), "alder_lake"), (183, 1, set(), "raptor_lake"),
    (250, 0, {"amx_tile", "avx512f"}, "sapphire_rapids"), (250, 0, {"avx512f"}, "skylake_server"),
    (250, 0, {"avx_vnni"}, "alder_lake"), (250, 0, {"avx2"}, "intel"),
    (167, 8, {"avx512f"}, "rocket_lake"), (167, 8, {"amx_tile", "avx512f"}, "sapphire_rapids"),  # a masked model
    (207, 2, {"amx_tile"}, "emerald_rapids"),
])
def test_intel_microarchitectures(model, stepping, flags, arch):
    assert microarch_of("Intel", 6, model, stepping, frozenset(flags)) == arch


@pytest.mark.parametrize("flags,level", [
    ({"avx2", "fma", "f16c"}, "avx2"),
    ({"avx2", "fma", "f16c", "avx_vnni"}, "avx_vnni"),
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl"}, "avx512"),
    ({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "avx512_vnni"),
    ({"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "amx_tile", "amx_int8"}, "amx"),
    ({"avx2", "fma"}, "scalar"),  # AVX2 without F16C is not a level quill builds for
    (set(), "scalar"),
])
def test_isa_levels(flags, level):
    assert Platform(flags=frozenset(flags)).isa_level == level


def test_limited_to_removes_the_levels_above_the_ceiling():
    zen4 = Platform(flags=frozenset({"avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni"}))
    assert zen4.limited_to("avx2").isa_level == "avx2"
    assert zen4.limited_to("native") is zen4
    with pytest.raises(ValueError, match="native, avx2"):
        zen4.limited_to("sse")


# ---- sysfs -------------------------------------------------------------------

def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def fake_sysfs(root: Path, n_cpus: int = 4, threads: int = 2) -> Path:
    """A /sys/devices/system/cpu tree: Zen-like caches on cpu0, topology for every CPU."""
    caches = [("1", "Data", "32K", "0,2"), ("1", "Instruction", "32K", "0,2"), ("2", "Unified", "1024K", "0,2"),
              ("3", "Unified", "32M", "0-3,64-67")]
    for i, (level, kind, size, shared) in enumerate(caches):
        d = root / "cpu0" / "cache" / f"index{i}"
        _write(d / "level", level)
        _write(d / "type", kind)
        _write(d / "size", size)
        _write(d / "shared_cpu_list", shared)
    for cpu in range(n_cpus):
        _write(root / f"cpu{cpu}" / "topology" / "physical_package_id", "0")
        _write(root / f"cpu{cpu}" / "topology" / "core_id", str(cpu % (n_cpus // threads)))
    return root


def test_sysfs_caches(tmp_path):
    sizes, shared = read_sysfs_caches(fake_sysfs(tmp_path))
    assert sizes == (("L1d", 32 * 1024), ("L2", 1024 * 1024), ("L3", 32 * 1024 * 1024))
    assert shared == (("L1d", 2), ("L2", 2), ("L3", 8))


def test_sysfs_caches_tolerates_missing_and_odd_entries(tmp_path):
    root = fake_sysfs(tmp_path)
    (root / "cpu0" / "cache" / "index2" / "size").write_text("unknown\n")  # skipped, not a crash
    (root / "cpu0" / "cache" / "index3" / "shared_cpu_list").unlink()  # size kept, sharing unknown
    sizes, shared = read_sysfs_caches(root)
    assert sizes == (("L1d", 32 * 1024), ("L3", 32 * 1024 * 1024))
    assert shared == (("L1d", 2),)
    assert read_sysfs_caches(tmp_path / "nonexistent") == ((), ())


def test_sysfs_core_count(tmp_path):
    assert read_sysfs_cores(fake_sysfs(tmp_path, n_cpus=8, threads=2)) == 4
    assert read_sysfs_cores(tmp_path / "nonexistent") is None


def test_detect_with_injected_files(tmp_path):
    sysfs = fake_sysfs(tmp_path / "sys", n_cpus=4, threads=2)
    path = tmp_path / "cpuinfo"
    path.write_text(cpuinfo("zen3_epyc7763_notopology4.txt"))
    p = detect(path, sysfs)
    assert (p.vendor, p.microarch, p.isa_level) == ("AMD", "zen3", "avx2")
    assert (p.physical_cores, p.logical_cpus) == (2, 4)  # cpuinfo has no topology: sysfs says 2 cores
    assert p.cache("L2") == 1024 * 1024 and p.cache("L3") == 32 * 1024 * 1024 and p.cache("L4") is None
    assert dict(p.cache_shared_cpus)["L3"] == 8


def test_detect_without_cpuinfo_warns(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="quill.platform"):
        p = detect(tmp_path / "missing", tmp_path)
    assert p.isa_level == "scalar" and p.logical_cpus >= 1
    assert "cannot read" in caplog.text


def test_detect_this_machine():
    p = detect()
    assert 1 <= p.physical_cores <= p.logical_cpus
    assert p.usable_cpus is None or 1 <= p.usable_cpus
    assert p.isa_level in ("amx", "avx512_vnni", "avx512", "avx_vnni", "avx2", "scalar")


def test_default_threads_are_the_physical_cores_this_process_may_use():
    """A container's cpuset or taskset caps the default: more threads than usable CPUs only take turns."""
    p = Platform(physical_cores=8, logical_cpus=16)
    assert p.default_threads == 8  # affinity unknown: every physical core
    assert replace(p, usable_cpus=16).default_threads == 8  # SMT siblings are not extra threads
    assert replace(p, usable_cpus=3).default_threads == 3
    assert replace(p, physical_cores=0).default_threads == 1
