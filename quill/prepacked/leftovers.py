"""Temporary files of cache writers, and the ones a killed writer leaves behind.

Every writer in the cache directory (a cache file, a digest record) writes a hidden temporary
name beside its target, ``.<target>.<pid>.<random>.tmp``, then renames it: readers never see
a torn file, but a writer killed mid-write (SIGKILL, power loss) leaves its temporary file.
One is *stale*, safe to delete, when its writer's pid is not running on this machine or
nothing has written to it for ``STALE_AFTER`` seconds (a pid reused by another process does
not keep it forever).  A cache directory shared between machines or pid namespaces can see a
live writer of another one as gone: deleting its file only makes that writer's rename fail
(a warning; the next load writes the file again).
"""

from __future__ import annotations

import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

STALE_AFTER = 600.0  # seconds: a live writer writes its file without pauses anywhere near this long
_NAME = re.compile(r"^\..+\.(?P<pid>\d+)(?:\.[0-9a-f]+)?\.tmp$")


def temp_path(path: Path) -> Path:
    """The temporary name a writer of ``path`` writes first (hidden, with the writer's pid)."""
    return path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def writer_pid(name: str) -> int | None:
    """The pid in a temporary file's name; None for a name no writer of the cache makes."""
    m = _NAME.match(name)
    return int(m.group("pid")) if m else None


def pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@dataclass(frozen=True)
class Leftover:
    """A writer's temporary file as ``quill cache list`` shows it."""

    path: Path
    size: int
    pid: int
    writer_running: bool
    idle: float  # seconds since it was last written

    @property
    def stale(self) -> bool:
        return not self.writer_running or self.idle > STALE_AFTER

    def describe(self) -> str:
        state = "being written" if not self.stale else \
            ("writer gone" if not self.writer_running else f"untouched for {self.idle / 60:.0f} min")
        return f"{self.path.name}  {self.size / 1e6:8.1f} MB  pid {self.pid}: {state}"


def find_leftovers(directories: list[Path]) -> list[Leftover]:
    """The writers' temporary files in ``directories``, live or not."""
    now, out = time.time(), []
    for d in directories:
        if not d.is_dir():
            continue
        for p in d.iterdir():
            pid = writer_pid(p.name)
            if pid is None or not p.is_file():
                continue
            try:
                st = p.stat()
            except FileNotFoundError:  # renamed or removed by its writer just now
                continue
            out.append(Leftover(p, st.st_size, pid, pid_running(pid), max(0.0, now - st.st_mtime)))
    return out


def remove_stale(directories: list[Path]) -> list[Leftover]:
    """Delete the stale temporary files in ``directories``; the ones deleted."""
    gone = []
    for left in find_leftovers(directories):
        if left.stale:
            left.path.unlink(missing_ok=True)
            gone.append(left)
    return gone
