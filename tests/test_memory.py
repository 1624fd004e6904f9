"""Reading a checkpoint unpacks one layer at a time: peak memory stays near one layer, not the model.

The peak is the kernel's resident-set high-water mark (VmHWM) of a fresh
subprocess, reset to the current RSS just before the layers are read (writing
"5" to /proc/self/clear_refs), so torch's import, a one-layer warm-up (code
pages, allocator arenas) and the test's own writing do not count.
Memory-mapped checkpoint pages that reading touches are resident too, so the
bound allows the whole packed file on top of a few unpacked layers.
"""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from checkpoint_writer import write_checkpoint

from quill.writers.gptq import canonical_to_gptq
from quill.writers.rtn import quantize_rtn

ROOT = Path(__file__).resolve().parent.parent
LAYERS, OUT, IN, SHARDS = 48, 1024, 1024, 4
MIB = 1 << 20

PROBE = textwrap.dedent("""
    import json, sys
    from quill.formats.checkpoint import open_checkpoint

    def status():
        fields = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
        return {k: int(fields[k].split()[0]) * 1024 for k in ("VmRSS", "VmHWM")}

    ckpt = open_checkpoint(sys.argv[1])
    ckpt.read_layer(next(iter(ckpt.plan)))  # warm-up: faults in torch's code pages and allocator arenas
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset the high-water mark to the current RSS
        reset = True
    except OSError:
        reset = False
    start = status()
    count = checksum = 0
    for name, qw in ckpt.quantized_layers():
        count += 1
        checksum += int(qw.codes[-1, -1]) + qw.codes.shape[1]
    end = status()
    print(json.dumps({"reset": reset, "start": start, "end": end, "count": count, "checksum": checksum}))
""")


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory):
    if not Path("/proc/self/status").is_file():
        pytest.fail("this test measures memory through /proc/self/status (Linux)")
    qw = quantize_rtn(torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)) * 0.02, 4, 128, False)
    tensors, checksum = {}, 0
    for i in range(LAYERS):  # every layer distinct: codes shifted by its index
        layer = qw.with_(codes=(qw.codes + i) % 16)
        tensors.update({f"model.layers.{i}.mlp.down_proj.{s}": t for s, t in canonical_to_gptq(layer).items()})
        checksum += int(layer.codes[-1, -1]) + IN
    path = write_checkpoint(tmp_path_factory.mktemp("mem"), tensors,
                            {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": False}, shards=SHARDS)
    return path, checksum


def test_peak_memory_stays_near_one_layer(big_checkpoint):
    path, checksum = big_checkpoint
    run = subprocess.run([sys.executable, "-c", PROBE, str(path)], capture_output=True, text=True, timeout=300,
                         cwd=ROOT, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    assert run.returncode == 0, run.stderr
    r = json.loads(run.stdout.strip().splitlines()[-1])
    assert r["count"] == LAYERS and r["checksum"] == checksum

    file_bytes = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    layer_codes = OUT * IN  # uint8 codes of one layer
    layer_int32 = 4 * OUT * IN  # an unpacked int32 copy of one layer
    bound = file_bytes + 3 * layer_int32 + 16 * MIB
    # the bound must catch a reader that keeps every layer's codes (or unpacks them all at once)
    assert bound < file_bytes + LAYERS * layer_codes
    baseline = r["start"]["VmRSS"] if r["reset"] else r["start"]["VmHWM"]
    growth = r["end"]["VmHWM"] - baseline
    assert growth <= bound, (f"peak grew {growth / MIB:.1f} MiB reading {LAYERS} layers; bound {bound / MIB:.1f} MiB "
                             f"(file {file_bytes / MIB:.1f} MiB, one layer unpacked {layer_int32 / MIB:.1f} MiB)")



_WHERE = """
import sys, torch
from quill.engine.memory import keep_step_memory
kept = keep_step_memory() if sys.argv[1] == "keep" else None
t = torch.empty(6 << 20).fill_(1.0)  # a step's 24 MiB intermediate
addr = t.data_ptr()
for line in open("/proc/self/maps"):
    span, *rest = line.split()
    lo, hi = (int(x, 16) for x in span.split("-"))
    if lo <= addr < hi:
        print(kept, "heap" if rest[-1] == "[heap]" else "mapping")
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_keep_step_memory_takes_step_buffers_from_the_heap():
    """The engine's allocator policy serves a step's 24 MiB block from the heap, which keeps freed
    pages for the next step; glibc's defaults (the control) map it apart and unmap it on free, so
    every step faulted such blocks in again (a 1.2B W4A8 prompt: 200-300K faults, docs/lab/BENCHMARKS-notebook.md)."""
    def run(mode):
        out = subprocess.run([sys.executable, "-c", _WHERE, mode], capture_output=True, text=True, check=True)
        return out.stdout.split()
    kept, where = run("keep")
    if kept != "True":
        pytest.skip("no glibc mallopt here")
    assert where == "heap"
    assert run("default") == ["None", "mapping"]
