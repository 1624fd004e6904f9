"""CPU time per streamed token of each Ray process behind `quill serve --replicas` (docs/lab/BENCHMARKS-notebook.md).

    quill serve --replicas 2 --threads-per-replica 1 --port 8124 &
    .venv/bin/python scripts/ray_ingress_cpu.py http://127.0.0.1:8124

Reads utime + stime of the ingress, HTTP proxy, replicas, Serve controller, raylet and GCS from
/proc before and after one 16-client load (quill.bench.load, 32 requests, seed 5).
"""

import asyncio
import os
import sys
import time

import httpx

from quill.bench.load import Workload, run_load

TAGS = ("QuillIngress", "ProxyActor", "QuillReplica", "ServeController", "raylet", "gcs_server")


def cpu_seconds() -> dict[str, float]:
    """utime + stime per kind of Ray process, summed over its processes."""
    out: dict[str, float] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        for tag in TAGS:
            if tag in cmd:
                out[tag] = out.get(tag, 0.0) + (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return out


def main(url: str) -> None:
    model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
    before, start = cpu_seconds(), time.time()
    summary = asyncio.run(run_load(url, model, Workload.random(32, seed=5), 16)).summary()
    after, wall = cpu_seconds(), time.time() - start
    tokens = summary["output_tokens"]
    print(f"wall {wall:.1f} s, {tokens} tokens, {summary['output_tok_s']:.1f} out tok/s")
    for tag, total in after.items():
        cpu = total - before.get(tag, 0.0)
        print(f"{tag:16s} cpu {cpu:6.2f} s  {1000 * cpu / tokens:6.3f} ms/token  {100 * cpu / wall:5.1f} % of a core")


if __name__ == "__main__":
    main(sys.argv[1].rstrip("/"))
