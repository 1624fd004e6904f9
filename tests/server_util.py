"""Start a real ``quill serve`` process on a free port and talk to it over HTTP."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
import time

import httpx

URL_LINE = re.compile(r"quill serve: '(?P<name>[^']+)' at (?P<url>http://\S+)/v1")


class ServerProcess:
    """``with ServerProcess("--max-num-seqs", "4") as s: httpx.get(s.url + "/health")``."""

    def __init__(self, *args: str, startup_timeout: float = 180.0):
        self.args = ["--port", "0", *args]
        self.timeout = startup_timeout
        self.proc: subprocess.Popen | None = None
        self.lines: list[str] = []
        self.url = self.name = None
        self._found = threading.Event()

    def __enter__(self) -> "ServerProcess":
        self.proc = subprocess.Popen([sys.executable, "-m", "quill", "serve", *self.args],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()
        if not self._found.wait(self.timeout) or self.url is None:
            self.stop(kill=True)
            raise RuntimeError("quill serve did not start:\n" + "".join(self.lines))
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop(kill=True)
        raise RuntimeError("quill serve never became healthy:\n" + "".join(self.lines))

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = URL_LINE.search(line)
            if m and not self._found.is_set():
                self.url, self.name = m.group("url"), m.group("name")
                self._found.set()
        self._found.set()  # it exited: stop waiting (url stays None if it never started)

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stop(self, kill: bool = False, timeout: float = 60.0) -> int:
        """SIGTERM (or SIGKILL) and wait; the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        return self.proc.wait(timeout)

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            code = self.stop()
            assert code == 0, f"quill serve exited {code}:\n" + "".join(self.lines)

    def metrics(self) -> dict[str, float]:
        """Unlabelled view of /metrics: metric name -> value summed over its labels (histogram buckets skipped)."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or "_bucket" in line:
                continue
            name, value = line.rsplit(" ", 1)
            name = name.split("{")[0]
            out[name] = out.get(name, 0.0) + float(value)
        return out
