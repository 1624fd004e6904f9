"""``quill serve --replicas 2`` on a Ray cluster started here on 127.0.0.1, talked to as users do.

The cluster is made the way a multi-node one is (``ray start --head``, then ``quill serve
--ray-address``): two replicas x one thread of the default model behind one ingress.  The
OpenAI-client tests of ``test_serve.py`` run against it unchanged (they are imported below, so
they take this module's ``server`` fixture), then the Ray-only ones: both replicas serve, a chat
stays on its replica, a killed replica is replaced while its requests end cleanly, and
shutdown leaves no Ray process behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import platform
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import openai
import pytest

import quill
from tests.server_util import ServerProcess

try:
    import ray  # noqa: F401
except ImportError:
    # Ray has wheels for Linux x86_64 / aarch64: there a missing extra is a broken install and fails
    # (make install and CI install it); elsewhere these tests cannot run.
    if sys.platform == "linux" and platform.machine() in ("x86_64", "aarch64"):
        raise ImportError("the ray extra is not installed: pip install 'quill[ray]' (make install does)") from None
    pytest.skip("Ray Serve has no wheel for this platform", allow_module_level=True)

from quill.serving.ray import CLUSTER_ENV  # noqa: E402

# The OpenAI-client subset of the single-server tests: the same code, now through the Ray ingress.
from tests.test_serve import (  # noqa: E402, F401
    QUESTIONS,
    chat_offline,
    streams_with_disconnects,
    test_bad_requests_are_4xx_naming_the_field,
    test_chat_greedy_equals_offline,
    test_chat_stream_equals_offline_and_reports_usage,
    test_completions_greedy_streamed_and_not_equal_offline,
    test_continuous_batching_late_request_starts_before_others_end,
    test_echo,
    test_load_generator_against_the_server,
    test_logprobs_match_offline,
    test_n_and_seed,
    test_openai_client_raises_on_bad_request,
    test_prefix_cache_second_chat_turn,
    test_stop_strings_and_finish_reason,
    test_unknown_model_and_route,
)

# Requests that once stopped an engine, now refused (or served greedy) by the ingress's checks.
from tests.test_serve_faults import (  # noqa: E402, F401
    probe_text,
    test_a_request_that_stopped_the_engine_is_a_400_naming_the_field,
    test_a_temperature_below_the_greedy_threshold_is_greedy,
)

RAY = str(Path(sys.executable).with_name("ray"))


def _ray_pids() -> set[int]:
    """Processes of any Ray cluster on this machine (its daemons and its workers)."""
    pids = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            cmd = Path(f"/proc/{entry}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z" and re.search(r"ray::|raylet|gcs_server|site-packages/ray/|ray/_private", cmd):
            pids.add(int(entry))
    return pids


def _wait_gone(pids: set[int], timeout: float = 60.0) -> set[int]:
    deadline = time.monotonic() + timeout
    while (left := pids & _ray_pids()) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


# How often the cluster's processes export their metrics to the node's agent (Ray's default: every 10 s).
# The tests that read the replicas' exported engine metrics wait for an export, some for two: every 2 s
# they wait a fifth as long.
METRICS_EXPORT_S = 2


class RayCluster:
    """``ray start --head`` on 127.0.0.1 in a temp dir of its own; ``stop()`` is ``ray stop``."""

    def __init__(self, cpus: int = 2):
        self.before = _ray_pids()
        self.temp = tempfile.mkdtemp(prefix="qray", dir="/tmp")  # short: Ray's socket paths have a length limit
        # Token authentication, as a cluster reachable from other machines should have: the head and
        # quill serve (which inherits this environment) read the token from this file.
        token = Path(self.temp, "auth_token")
        token.write_text(secrets.token_hex(32))
        self.saved_env = os.environ.get("RAY_AUTH_TOKEN_PATH")
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
        port, self.metrics_port = _free_port(), _free_port()
        self.address = f"127.0.0.1:{port}"
        subprocess.run([RAY, "start", "--head", "--node-ip-address", "127.0.0.1", "--port", str(port),
                        "--num-cpus", str(cpus), "--include-dashboard", "false", "--disable-usage-stats",
                        "--metrics-export-port", str(self.metrics_port), "--temp-dir", self.temp],
                       check=True, capture_output=True, timeout=180,
                       env={**os.environ, **CLUSTER_ENV,  # as quill serve's own cluster
                            "RAY_metrics_report_interval_ms": str(METRICS_EXPORT_S * 1000)})

    def metrics(self, name: str) -> dict[str, float]:
        """Replica id -> value of Ray's exported metric ``ray_<name>`` (the replicas' engine gauges)."""
        text = httpx.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10).text
        out = {}
        for m in re.finditer(rf"^ray_{name}\{{(.*)\}} ([0-9.e+-]+)$", text, re.M):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
            out[labels.get("replica", "")] = float(m.group(2))
        return out

    def stop(self) -> set[int]:
        """``ray stop``; the Ray processes that outlive it (none expected)."""
        ours = _ray_pids() - self.before
        subprocess.run([RAY, "stop"], capture_output=True, timeout=180)
        left = _wait_gone(ours)
        shutil.rmtree(self.temp, ignore_errors=True)
        if self.saved_env is None:
            os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
        else:
            os.environ["RAY_AUTH_TOKEN_PATH"] = self.saved_env
        return left


def _free_port() -> int:
    """A free port outside the ephemeral range, which Ray's own processes draw from (quill serve's pick)."""
    from quill.serving.ray import _free_port as pick
    return pick("127.0.0.1", 0)


@pytest.fixture(scope="module", autouse=True)
def _every_cpu(unpinned):
    """Ray's processes on both CPUs (tests/conftest.py's `unpinned`), started before the cluster."""


@pytest.fixture(scope="module")
def cluster():
    c = RayCluster()
    try:
        yield c
    finally:
        left = c.stop()
        if left:
            subprocess.run(["kill", "-9", *map(str, left)])
        assert not left, f"Ray processes left after ray stop: {sorted(left)}"


@pytest.fixture(scope="module")
def server(cluster):
    s = ServerProcess("--replicas", "2", "--threads-per-replica", "1", "--max-num-seqs", "16",
                      "--stream-interval", "3",  # a replica's Ray items carry up to 3 tokens (n = 1)
                      "--isa", "avx2",  # the replicas run the AVX2 variants (the same bits as the native ones)
                      "--ray-address", cluster.address, startup_timeout=300)
    with s:
        yield s
    assert s.proc.returncode == 0


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def llm():
    return quill.LLM(threads=1)  # what each replica runs


def _metric_lines(server, name: str) -> list[tuple[dict[str, str], float]]:
    """(labels, value) of every sample of ``name`` in /metrics."""
    text = httpx.get(server.url + "/metrics", timeout=10).text
    out = []
    for m in re.finditer(rf"^{name}(?:\{{(.*)\}})? ([0-9.e+-]+)$", text, re.M):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or ""))
        out.append((labels, float(m.group(2))))
    return out


def _replicas(server) -> dict[str, dict]:
    """Per replica seen by the ingress: {"pid": ..., "requests": ...} from /metrics."""
    out: dict[str, dict] = {}
    for labels, _ in _metric_lines(server, "quill_replica_info"):
        out.setdefault(labels["replica"], {})["pid"] = int(labels["pid"])
    for labels, value in _metric_lines(server, "quill_replica_requests_total"):
        out.setdefault(labels["replica"], {})["requests"] = value
    return out


def _counter(server, name: str) -> float:
    return sum(value for _, value in _metric_lines(server, name))


async def _chat(http: httpx.AsyncClient, question: str, user: str | None = None, stream: bool = False,
                max_tokens: int = 24) -> tuple[int, str, str | None]:
    """(status, text, error) of one chat; a stream's error event counts as its error."""
    body = {"messages": [{"role": "user", "content": question}], "max_tokens": max_tokens, "temperature": 0,
            "stream": stream, **({"user": user} if user else {})}
    if not stream:
        r = await http.post("/v1/chat/completions", json=body)
        if r.status_code != 200:
            return r.status_code, "", r.json()["error"]["message"]
        return 200, r.json()["choices"][0]["message"]["content"], None
    text, error = [], None
    async with http.stream("POST", "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            return r.status_code, "", json.loads(await r.aread())["error"]["message"]
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                error = event["error"]["message"]
                continue
            text += [c["delta"].get("content") or "" for c in event["choices"]]
    return 200, "".join(text), error


def _run(coro):
    return asyncio.run(coro)


async def _many(server, questions: list[tuple[str, str | None, bool]], max_tokens: int = 24):
    async with httpx.AsyncClient(base_url=server.url, timeout=300,
                                 limits=httpx.Limits(max_connections=100)) as http:
        return await asyncio.gather(*[_chat(http, q, u, s, max_tokens) for q, u, s in questions])


# ---- Ray-only ------------------------------------------------------------------------------------

def test_both_replicas_serve_and_outputs_equal_offline(server, llm):
    qs = [(f"{QUESTIONS[i % len(QUESTIONS)]} ({i})", f"user-{i}", i % 2 == 0) for i in range(16)]
    results = _run(_many(server, qs))
    for (q, _, _), (status, text, error) in zip(qs, results):
        assert status == 200 and error is None
        assert text == chat_offline(llm, q, 24).text
    served = _replicas(server)
    assert len(served) == 2 and all(r["requests"] >= 1 for r in served.values()), served
    assert len({r["pid"] for r in served.values()}) == 2
    assert [_nice(r["pid"]) for r in served.values()] == [0, 0]  # not Ray's nice 15 (quill.serving.ray.CLUSTER_ENV)
    # the replicas' arithmetic, said as one `quill serve` process says it
    said = [line for line in server.lines if line.startswith("quill: activations: int8 per token and weight group")]
    assert len(said) == 1 and "KV cache: float16" in said[0], "".join(server.lines)


def test_a_chat_stays_on_its_replica(server):
    """Calls with one affinity key (here the ``user`` field) land on one replica while load is even."""
    before = _replicas(server)
    for _ in range(4):
        _run(_many(server, [("Tell me about owls.", "sticky-user", False)]))
    after = _replicas(server)
    grew = {rid: after[rid]["requests"] - before.get(rid, {}).get("requests", 0) for rid in after}
    assert sorted(grew.values()) == [0, 4], grew


def test_many_streaming_clients_some_disconnecting_leave_the_replicas_idle(cluster, server, llm):
    """64 concurrent streams through the ingress, 10 cut mid-stream: the rest finish with their offline
    text, and every replica's engine (Ray's exported metrics) ends with nothing running or holding KV (and
    exports speculation's counters, 0 with it off)."""
    streams_with_disconnects(server, llm)
    deadline = time.monotonic() + 60  # Ray's metrics agent exports every METRICS_EXPORT_S
    while True:
        generated = cluster.metrics("quill_generation_tokens")
        running = cluster.metrics("quill_num_requests_running")
        used = cluster.metrics("quill_kv_cache_blocks_used")
        live = {r for r, v in generated.items() if v > 0}
        drafts = cluster.metrics("vllm_spec_decode_num_drafts")  # speculation's counters, vLLM's names
        if len(live) >= 2 and all(running.get(r) == 0 and used.get(r) == 0 and drafts.get(r) == 0 for r in live):
            break
        assert time.monotonic() < deadline, (generated, running, used, drafts)
        time.sleep(1)
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def _nice(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[16])


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_stops_its_request_on_the_replica(server, stream):
    """The ingress cancels the replica's call when its client goes: the replica stops decoding
    (a 3000-token request would keep a replica busy for tens of seconds)."""
    body = {"prompt": "Count slowly:", "max_tokens": 3000, "temperature": 0, "ignore_eos": True, "stream": stream,
            "user": f"leaver-{stream}"}
    if stream:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
            for i, _ in enumerate(r.iter_lines()):
                if i > 20:
                    break
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", json=body, timeout=1.5)
    time.sleep(1.0)
    pids = [r["pid"] for r in _replicas(server).values() if Path(f"/proc/{r['pid']}").exists()]
    before = {pid: _cpu_seconds(pid) for pid in pids}
    time.sleep(3.0)
    busy = {pid: _cpu_seconds(pid) - t for pid, t in before.items()}
    assert all(v < 1.0 for v in busy.values()), busy  # decoding would take ~3 s of CPU here


def test_a_cut_stream_is_aborted_on_its_replica(cluster, server):
    """A 1000-token stream cut after a few tokens is aborted by its replica, as Ray's exported engine
    metrics show: one more aborted request, no request running or KV block in use, and far fewer
    than 1000 tokens generated."""
    def total(name: str) -> float:
        return sum(cluster.metrics(name).values())

    def idle() -> bool:
        running, used = cluster.metrics("quill_num_requests_running"), cluster.metrics("quill_kv_cache_blocks_used")
        return not any(running.values()) and not any(used.values())

    deadline = time.monotonic() + 60  # an earlier test's aborts counted first (exported with its idle gauges)
    while not idle():
        assert time.monotonic() < deadline, "the replicas never went idle before the test"
        time.sleep(1)
    # Ray exports a counter some seconds after the gauges: an earlier test's abort can land after idle() holds
    # (seen: +2 here). The baseline is a count that held for longer than two export periods.
    aborted = total("quill_requests_aborted")
    while True:
        time.sleep(2 * METRICS_EXPORT_S + 1)
        now = total("quill_requests_aborted")
        if now == aborted:
            break
        assert time.monotonic() < deadline, "the aborted count never settled before the test"
        aborted = now
    generated = total("quill_generation_tokens")
    body = {"prompt": "Count slowly:", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True,
            "user": "cut-stream"}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break
    deadline = time.monotonic() + 60  # Ray's metrics agent exports every METRICS_EXPORT_S
    while not (total("quill_requests_aborted") == aborted + 1 and idle()):
        assert time.monotonic() < deadline, (total("quill_requests_aborted"), aborted)
        time.sleep(1)
    assert total("quill_generation_tokens") - generated < 500


def test_a_call_no_replica_can_ever_hold_is_a_400(server):
    """5 prompts x n=64 is more than a replica ever holds (16 running + 256 waiting): a 400 from the
    replica's refusal, not a 503 inviting retries."""
    r = httpx.post(server.url + "/v1/completions", json={"prompt": ["a"] * 5, "n": 64, "max_tokens": 1}, timeout=60)
    assert r.status_code == 400 and "retry-after" not in r.headers, r.text
    err = r.json()["error"]
    assert err["param"] == "n" and "at once: 272 " in err["message"], err


def test_killed_replica_requests_end_cleanly_and_it_comes_back(server, llm):
    deadline = time.monotonic() + 120
    while len(served := _replicas(server)) < 2:  # (run alone, no earlier test has reached both replicas)
        assert time.monotonic() < deadline, f"both replicas never served: {served}"
        _run(_many(server, [(f"Name a fish ({i})", f"warm-{time.monotonic()}-{i}", False) for i in range(6)]))
    victim_key, victim = next((k, r["pid"]) for k, r in served.items())
    qs = [(f"{QUESTIONS[i % len(QUESTIONS)]} [{i}]", f"load-{i}", i % 2 == 0) for i in range(24)]

    async def load_then_kill():
        # Kill once the ingress has sent the victim requests of this load, while they decode (a fixed
        # sleep raced the load on a fast machine: every request had finished before the kill).
        sent = served[victim_key].get("requests", 0)
        task = asyncio.ensure_future(_many(server, qs, max_tokens=96))
        deadline = time.monotonic() + 60
        while not task.done() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            now = await asyncio.to_thread(_replicas, server)
            if now.get(victim_key, {}).get("requests", 0) > sent:
                break
        await asyncio.sleep(0.2)  # past their prefill, into decoding
        os.kill(victim, signal.SIGKILL)
        return await task

    results = _run(load_then_kill())
    failed = 0
    for (q, _, stream), (status, text, error) in zip(qs, results):
        if status == 200 and error is None:
            assert text == chat_offline(llm, q, 96).text, q
            continue
        failed += 1
        assert status == 503 or (stream and status == 200 and error), (status, error)
        assert "stopped" in error
    # Unstreamed requests are sent again once when their replica dies (nothing had reached the client).
    assert all(s == 200 and e is None for (_, _, stream), (s, _, e) in zip(qs, results) if not stream)
    assert _counter(server, "quill_replica_retries_total") + failed >= 1  # the kill hit someone
    deadline = time.monotonic() + 180
    while True:  # Ray replaces the replica; requests with fresh keys soon reach the new one
        later = _run(_many(server, [(f"Name a bird ({time.monotonic()})", f"after-{time.monotonic()}-{i}", False)
                                    for i in range(6)]))
        assert all(status == 200 and error is None for status, _, error in later), later
        pids = {r["pid"] for r in _replicas(server).values()}
        if len(pids - {victim} - {r["pid"] for r in served.values()}) >= 1:
            break
        assert time.monotonic() < deadline, f"no new replica served after the kill: {_replicas(server)}"
        time.sleep(2)
    assert httpx.get(server.url + "/health").status_code == 200


# ---- a cluster of its own ---------------------------------------------------------------------------

def test_own_cluster_autoscales_under_load_and_stops_clean():
    """No --ray-address: quill serve starts a cluster of its own, scales 1 -> 2 replicas on queue length,
    and takes every Ray process with it on SIGTERM."""
    before = _ray_pids()
    fast = '{"upscale_delay_s": 0.5, "metrics_interval_s": 0.5, "look_back_period_s": 2}'
    with ServerProcess("--min-replicas", "1", "--max-replicas", "2", "--target-ongoing-requests", "1",
                       "--autoscaling-config", fast, "--threads-per-replica", "1", startup_timeout=300) as s:
        ours = _ray_pids() - before
        assert ours  # a cluster of its own
        assert len(_replicas(s)) <= 1
        deadline = time.monotonic() + 180
        while len(_replicas(s)) < 2:  # keep 8 long requests queued until a second replica serves some
            assert time.monotonic() < deadline, f"never scaled to 2 replicas: {_replicas(s)}"
            qs = [(f"Tell a long story {time.monotonic()} #{i}", f"scale-{time.monotonic()}-{i}", False)
                  for i in range(8)]
            assert all(status == 200 for status, _, _ in _run(_many(s, qs, max_tokens=64)))
        assert [_nice(r["pid"]) for r in _replicas(s).values()] == [0, 0]  # its workers at normal priority
    assert s.proc.returncode == 0
    assert not _wait_gone(ours), "quill serve left Ray processes behind"


def test_config_errors_are_clear(capsys):
    """Refused before anything starts: the first through a real process, the rest through the same entry
    point in this one (each process spent ~6 s importing torch and Ray to print one line)."""
    from quill.cli import main

    r = subprocess.run([sys.executable, "-m", "quill", "serve", "--replicas", "2", "--min-replicas", "1"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--min-replicas" in r.stderr

    def run(*a: str) -> str:
        try:
            code = main(["serve", *a])
        except SystemExit as e:  # argparse's own refusals
            code = e.code
        assert code != 0, a
        return capsys.readouterr().err

    assert "--threads-per-replica" in run("--replicas", "1", "--threads", "2")
    assert "replicas" in run("--replicas", "0")
    assert "--max-replicas" in run("--min-replicas", "1")
    assert "upscale_delay_s" in run("--min-replicas", "1", "--max-replicas", "2", "--autoscaling-config",
                                    '{"upscale_delay_s": -1}')
    assert "JSON object" in run("--min-replicas", "1", "--max-replicas", "2", "--autoscaling-config", "[1]")


# ---- pieces without a cluster ----------------------------------------------------------------------

def test_rendezvous_home_moves_only_for_keys_of_a_removed_replica():
    from quill.serving.router import rendezvous_order
    ids, keys = ["r1", "r2", "r3", "r4"], [f"chat-{i}" for i in range(800)]
    home = {k: rendezvous_order(k, ids)[0] for k in keys}
    shares = [sum(h == r for h in home.values()) for r in ids]
    assert min(shares) > 120, shares  # spread over every replica (200 each on average)
    after = {k: rendezvous_order(k, ["r1", "r2", "r4"])[0] for k in keys}
    assert all(after[k] == home[k] for k in keys if home[k] != "r3")
    assert {after[k] for k in keys if home[k] == "r3"} == {"r1", "r2", "r4"}


def test_build_app_for_serve_run_reads_string_arguments():
    from ray.serve import Application

    from quill.errors import ConfigError
    from quill.serving.ray import RayServeOptions, build_app
    app = build_app({"replicas": "3", "threads_per_replica": "1", "max_num_seqs": "4", "dtype": "bfloat16",
                     "enable_prefix_caching": "false", "api_key": "k"})
    assert isinstance(app, Application)
    opts = RayServeOptions(replicas=3, engine={"max_num_seqs": 4})
    assert opts.engine_config.kv_cache_fraction == pytest.approx(0.2 / 3)  # three replicas share the default
    with pytest.raises(ConfigError, match="unknown argument 'replica'"):
        build_app({"replica": "2"})
    with pytest.raises(ConfigError, match="max_num_seqs: expected an integer"):
        build_app({"max_num_seqs": "many"})
    with pytest.raises(ConfigError, match="min_replicas .* above max_replicas"):
        RayServeOptions(replicas=None, min_replicas=3, max_replicas=2)
