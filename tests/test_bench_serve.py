"""quill bench serve / spec: stopped by SIGTERM they close the servers they started, as Ctrl-C does, while a server
is still starting (spec starts its servers in parallel threads) and while the load runs; llama-server's web UI
turned off as each build spells it."""

import os
import re
import signal
import subprocess
import sys
import time

import httpx


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:  # the field after the state: ppid
            out.append(int(d))
    return out


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie left for init to reap is gone too
    except OSError:
        return True


def _port(pid: int) -> int | None:
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        m = re.search(rb"--port\x00(\d+)", f.read())
    return int(m.group(1)) if m else None


def _wait(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def _healthy(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _terminate_and_check(bench: subprocess.Popen, servers: list[int]) -> None:
    bench.send_signal(signal.SIGTERM)
    try:
        assert bench.wait(120) == 128 + signal.SIGTERM
        _wait(lambda: all(_gone(p) for p in servers), 30, "the servers to stop")
    finally:  # a failure leaves nothing running behind it
        for pid in [bench.pid, *servers]:
            if not _gone(pid):
                os.kill(pid, signal.SIGKILL)


def test_bench_serve_sigterm_during_the_load_stops_its_server(tmp_path):
    bench = subprocess.Popen([sys.executable, "-m", "quill", "bench", "serve", "--clients", "1", "--rounds", "50",
                              "--threads", "1", "--json", str(tmp_path / "never.json")],
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        (server,) = _wait(lambda: _children(bench.pid), 120, "quill serve to start")
        port = _port(server)
        assert port is not None
        _wait(lambda: _healthy(port), 120, "quill serve to answer")
        time.sleep(1.0)  # the load is running
    except BaseException:
        bench.kill()
        raise
    _terminate_and_check(bench, [server])
    assert not (tmp_path / "never.json").exists()


def test_bench_spec_sigterm_while_its_servers_start_stops_them():
    bench = subprocess.Popen([sys.executable, "-m", "quill", "bench", "spec", "--methods", "none,ngram", "--k", "2",
                              "--max-tokens", "8", "--clients", "1", "--rounds", "50", "--prompts", "1",
                              "--threads", "1"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        # signalled as soon as both exist: they are loading, the threads that started them wait for them
        servers = _wait(lambda: (lambda c: c if len(c) == 2 else None)(_children(bench.pid)), 120,
                        "both quill servers to be started")
    except BaseException:
        bench.kill()
        raise
    _terminate_and_check(bench, servers)


def test_llama_server_web_ui_flag_as_each_build_spells_it(tmp_path):
    from quill.bench.serve import _no_webui

    def server(help_line: str):
        path = tmp_path / f"server{len(list(tmp_path.iterdir()))}"
        path.write_text(f"#!/bin/sh\necho '{help_line}'\n")
        path.chmod(0o755)
        return str(path)

    # the lines of mainline's (0.3.36's vendored llama.cpp) and ik_llama.cpp 8337e4c's --help
    mainline = "--ui,  --webui, --no-ui, --no-webui     whether to enable the Web UI (default: enabled)"
    assert _no_webui(server(mainline)) == ["--no-webui"]
    ik = "--ui-mcp-proxy, --webui-mcp-proxy\n         --webui NAME             controls which webui to server:"
    assert _no_webui(server(ik)) == ["--webui", "none"]
    assert _no_webui(server("-h, --help")) == []
