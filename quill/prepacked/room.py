"""How much the prepacked cache may hold, and making room before a write.

    QUILL_CACHE_MAX_SIZE   the largest total of the cache's files: bytes, or 500M, 40G, 1.5T (powers of 1024);
                           default none
    QUILL_CACHE_MIN_FREE   the space a write leaves free on the cache's disk: the same units, or a share of the
                           disk (5%); default 2G

Before a file is written, the least recently used files (a hit touches its file's mtime) are deleted until
the new one fits both limits; a file that would not fit even in an empty cache is not written (the next load
converts again).  Why: every kernel choice, ISA and checkpoint is a file of its own, about the size of the
model, and nothing else ever deletes them: an unbounded cache filled a benchmark host's disk (56 GB).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from quill.errors import ConfigError

log = logging.getLogger("quill.prepacked")

MAX_SIZE_ENV = "QUILL_CACHE_MAX_SIZE"
MIN_FREE_ENV = "QUILL_CACHE_MIN_FREE"
_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*([KMGT]?)(?:I?B)?\s*$", re.IGNORECASE)
_SHARE = re.compile(r"^\s*(\d+(?:\.\d*)?)\s*%\s*$")


def parse_size(text: str, name: str, *, share: bool = False) -> int | float:
    """Bytes from ``text`` ("500M", "40G", "1.5T", "123456"); with ``share``, "5%" gives the float 0.05."""
    if share and (m := _SHARE.match(text)):
        value = float(m.group(1))
        if value <= 100:
            return value / 100
    elif m := _SIZE.match(text):
        return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    what = "a size (bytes, or a number with K, M, G or T)" + (", or a share of the disk (5%)" if share else "")
    raise ConfigError(f"{name}={text!r}: expected {what}")


def gb(n: float) -> str:
    """Bytes for a log line: GB, or MB below one GB."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


@dataclass(frozen=True)
class Room:
    """The cache's limits: ``max_size`` bytes (None: no limit) and ``min_free`` (bytes, or a share of the disk
    when a float)."""

    max_size: int | None = None
    min_free: int | float = _UNITS["G"] * 2

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Room:
        env = os.environ if env is None else env
        raw_max = env.get(MAX_SIZE_ENV, "").strip()
        raw_free = env.get(MIN_FREE_ENV, "").strip()
        return cls(int(parse_size(raw_max, MAX_SIZE_ENV)) if raw_max else None,
                   parse_size(raw_free, MIN_FREE_ENV, share=True) if raw_free else cls.min_free)

    def free_bytes(self, disk_total: int) -> int:
        return int(self.min_free * disk_total) if isinstance(self.min_free, float) else self.min_free

    def describe(self, directory: Path) -> str:
        """One line for ``quill cache list``: the limits and the disk's state."""
        usage = disk_usage(directory)
        cap = f"at most {gb(self.max_size)} ({MAX_SIZE_ENV})" if self.max_size is not None else \
            f"no size limit ({MAX_SIZE_ENV} unset)"
        free = gb(self.free_bytes(usage.total)) if usage else str(self.min_free)
        now = f"; {gb(usage.free)} free now" if usage else ""
        return f"limits: {cap}; a write leaves {free} free on the disk ({MIN_FREE_ENV}){now}; " \
               f"the least recently used files go first"

    def plan(self, files: list[tuple[Path, int, float]], incoming: int, free: int, disk_total: int) \
            -> list[Path] | None:
        """Which of ``files`` (path, size, last used) to delete, least recently used first, so that ``incoming``
        more bytes fit; None when they would not fit even with every file deleted."""
        total = sum(size for _, size, _ in files)
        keep_free = self.free_bytes(disk_total)
        victims = []
        for path, size, _ in sorted(files, key=lambda f: f[2]):
            if self._fits(total, free, incoming, keep_free):
                break
            victims.append(path)
            total, free = total - size, free + size
        return victims if self._fits(total, free, incoming, keep_free) else None

    def _fits(self, total: int, free: int, incoming: int, keep_free: int) -> bool:
        return (self.max_size is None or total + incoming <= self.max_size) and free - incoming >= keep_free


def disk_usage(directory: Path):
    """shutil.disk_usage of ``directory`` or its nearest existing parent; None when none can be read."""
    for d in (directory, *directory.parents):
        try:
            return shutil.disk_usage(d)
        except OSError:
            continue
    return None


def make_room(room: Room, files_dir: Path, written: Path, incoming: int, suffix: str) -> bool:
    """Delete the least recently used cache files in ``files_dir`` (``written`` aside) so that ``incoming`` more
    bytes fit ``room``; False, deleting nothing, when they cannot."""
    usage = disk_usage(files_dir)
    if usage is None:
        return True  # nothing to measure against: the write itself will tell
    files = []
    for path in files_dir.glob(f"*{suffix}"):
        if path == written:
            continue
        try:
            st = path.stat()
        except OSError:
            continue  # deleted by another process meanwhile
        files.append((path, st.st_size, st.st_mtime))
    victims = room.plan(files, incoming, usage.free, usage.total)
    if victims is None:
        log.warning("prepacked cache: not writing %s (%s): it would not fit %s with every other file deleted "
                    "(%s free on the disk); the next load converts the checkpoint again",
                    written, gb(incoming), _limits(room, usage.total), gb(usage.free))
        return False
    for path in victims:
        path.unlink(missing_ok=True)
        log.info("prepacked cache: removed %s, the least recently used, to keep within %s", path.name,
                 _limits(room, usage.total))
    return True


def _limits(room: Room, disk_total: int) -> str:
    cap = f"{gb(room.max_size)} ({MAX_SIZE_ENV}) and " if room.max_size is not None else ""
    return f"{cap}{gb(room.free_bytes(disk_total))} left free ({MIN_FREE_ENV})"
