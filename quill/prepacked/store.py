"""The prepacked cache directory: one file per (checkpoint content, kernel choice, ISA, quill build).

    <cache>/prepacked/<key>.safetensors   a loaded model's kernel layouts (quill.prepacked.file)
    <cache>/sources/<path hash>.json      a checkpoint's content digest and its files' fingerprint
    <cache>/*/.<name>.<pid>.<random>.tmp  a file being written (quill.prepacked.leftovers)

``<cache>`` is ``--cache-dir`` / ``LLM(cache_dir=)``, else ``$QUILL_CACHE_DIR``, else
``$XDG_CACHE_HOME/quill`` (``~/.cache/quill``).  The key hashes the checkpoint's content
digest, what decides each layer's kernel (the kernel and MoE policies, activation
quantization, compute dtype), the CPU's ISA flags, and quill's version with the native
extension's build: a change to any of them is a different file, so a stale entry is never
read (``quill cache clear`` removes old ones).  A file that fails its checks is deleted with a
warning naming it and the check, and rebuilt from the checkpoint.  Temporary files of writers
that were killed are deleted after the next write (``quill cache list`` shows them,
``quill cache prune`` deletes them and unusable files at once).  Before a write the least recently
used files make room within ``$QUILL_CACHE_MAX_SIZE`` and ``$QUILL_CACHE_MIN_FREE`` (quill.prepacked.room).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import xxhash

from quill.errors import CacheError
from quill.prepacked import digest as digests
from quill.prepacked.header import Header, read_header
from quill.prepacked.leftovers import Leftover, find_leftovers, remove_stale
from quill.prepacked.room import Room, make_room

if TYPE_CHECKING:
    import torch

    from quill.prepacked.file import MappedData

log = logging.getLogger("quill.prepacked")

# Bump when a saved layout (a kernel's state, a slot's facts) or the file changes meaning.  2: the header's
# own checksum (format 1 files checked the data only: they are superseded and rebuilt, never read).
CACHE_FORMAT = 2
SUFFIX = ".safetensors"
_OFF = ("0", "off", "false", "no")


def default_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """``$QUILL_CACHE_DIR``, else ``$XDG_CACHE_HOME/quill``, else ``~/.cache/quill``."""
    env = os.environ if env is None else env
    if env.get("QUILL_CACHE_DIR"):
        return Path(env["QUILL_CACHE_DIR"]).expanduser()
    return Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "quill"


def cache_enabled(env: Mapping[str, str] | None = None) -> bool:
    """False when ``$QUILL_CACHE`` is 0 / off / false / no."""
    env = os.environ if env is None else env
    return env.get("QUILL_CACHE", "1").strip().lower() not in _OFF


def build_id() -> dict:
    """quill's version, the cache format and the native extension's build (its file's size and time)."""
    import quill
    from quill import native
    ext = native.load().module
    if ext is None:
        built = "none"
    else:
        st = Path(ext.__file__).stat()
        built = f"{st.st_size}-{st.st_mtime_ns}"
    return {"quill": quill.__version__, "format": CACHE_FORMAT, "native": built}


@dataclass(frozen=True)
class CacheKey:
    """What a cache file is valid for; ``name`` is its file name."""

    digest: str  # the checkpoint's content
    choice: str  # JSON: kernel / MoE policy, activation, dtype, ISA flags, quill build

    @property
    def name(self) -> str:
        return xxhash.xxh3_128(f"{self.digest}\0{self.choice}".encode()).hexdigest()


@dataclass
class CacheEntry:
    """One cache file as ``quill cache list`` shows it."""

    path: Path
    size: int
    source: str
    model_type: str
    kernels: str
    created: float
    built_by: str
    problem: str | None = None  # why the file is unusable (header), None when it reads


class PendingRead:
    """A cache file whose header is read and whose data is being mapped and checked on a thread."""

    def __init__(self, path: Path, header: Header):
        from quill.prepacked.file import map_data  # torch: only a load maps data (`quill cache list` reads headers)
        self.path, self.header = path, header
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="quill-cache-read")
        self._future: Future = self._pool.submit(map_data, path, header)
        self._pool.shutdown(wait=False)

    @property
    def facts(self) -> dict:
        return self.header.facts

    @property
    def tokenizer_json(self) -> str | None:
        return self.header.metadata.get("tokenizer")

    def data(self) -> MappedData:
        """Wait for the data; a CacheError when it is truncated or its checksum differs."""
        return self._future.result()

    def settle(self) -> None:
        """Wait for the read to end, whatever it found (before the file is deleted)."""
        self._future.exception()


class PrepackedCache:
    """Find, read, write, list and clear prepacked models under ``directory``."""

    def __init__(self, directory: str | os.PathLike | None = None):
        self.directory = Path(directory).expanduser() if directory is not None else default_cache_dir()
        self.files_dir = self.directory / "prepacked"
        self.sources_dir = self.directory / "sources"
        self.room = Room.from_env()  # a bad value is a ConfigError here, before the load
        self._writers: list[threading.Thread] = []

    def key(self, checkpoint: Path, choice: dict) -> CacheKey:
        """The key of ``checkpoint`` loaded under ``choice`` (quill.layers.snapshot.choice_of); may read the
        checkpoint once to digest it."""
        return CacheKey(digests.digest(checkpoint, self.sources_dir),
                        json.dumps({**choice, **build_id()}, sort_keys=True))

    def path(self, key: CacheKey) -> Path:
        return self.files_dir / f"{key.name}{SUFFIX}"

    def open(self, key: CacheKey) -> PendingRead | None:
        """Start reading the file of ``key``; None on a miss (or a file whose header fails: deleted)."""
        path = self.path(key)
        try:
            header = read_header(path)
        except FileNotFoundError:
            return None
        except (CacheError, OSError) as e:
            self.discard(path, e)
            return None
        try:
            os.utime(path)  # its mtime says when it was last used: the least recently used go first
        except OSError as e:  # a read-only cache is still read
            log.debug("prepacked cache: %s not touched: %s", path, e)
        return PendingRead(path, header)

    def discard(self, path: Path, why: Exception) -> None:
        """Delete an unusable cache file (it will be rebuilt), saying which and why."""
        reason = str(why).removeprefix(f"{path}: ")
        if not isinstance(why, (CacheError, OSError)):  # a fact the restore could not use (KeyError: 'x')
            reason = f"{type(why).__name__}: {reason}"
        log.warning("prepacked cache: deleted %s, unusable: %s; rebuilding it from the checkpoint", path, reason)
        path.unlink(missing_ok=True)

    def save(self, key: CacheKey, export: Callable[[], tuple[dict, dict[str, torch.Tensor], dict[str, str]]]) -> \
            threading.Thread:
        """Write the model ``export()`` describes as the file of ``key``, on a thread (the caller goes on).

        ``export`` runs here, on the caller's thread: (facts, tensors, metadata).  The thread is not a
        daemon, so a short-lived process finishes writing before it exits.
        """
        facts, tensors, metadata = export()
        tensors = {k: t.contiguous() for k, t in tensors.items()}  # torch work stays on the loading thread
        self.files_dir.mkdir(parents=True, exist_ok=True)
        facts = {**facts, "key": json.loads(key.choice), "digest": key.digest, "created": time.time()}
        # the file's size, near enough to make room for it: data, metadata, a header line per tensor
        nbytes = sum(t.numel() * t.element_size() + 256 for t in tensors.values()) + \
            sum(len(v) for v in metadata.values()) + len(json.dumps(facts)) + (1 << 20)
        thread = threading.Thread(target=self._write, args=(self.path(key), tensors, metadata, facts, nbytes),
                                  name="quill-cache-write")
        thread.start()
        self._writers.append(thread)
        return thread

    def _write(self, path: Path, tensors: dict, metadata: dict, facts: dict, nbytes: int) -> None:
        # The lowest CPU priority: the file is for the next load, and the model this load just built is
        # serving now (a fresh MoE checkpoint's first decode ran at a fifth of its speed beside the write).
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)  # a thread's own nice value (Linux)
        except OSError as e:  # elsewhere the write runs at the process's priority
            log.debug("prepacked cache: writer priority unchanged: %s", e)
        from quill.prepacked.file import write_file  # torch: only a load writes (`quill cache` commands do not)
        try:
            if not make_room(self.room, self.files_dir, path, nbytes, SUFFIX):
                return
            size = write_file(path, tensors, metadata, facts)
            log.info("prepacked cache: wrote %s (%.1f MB)", path, size / 1e6)
            self._prune(path, facts)
            for left in remove_stale(self._dirs()):
                log.info("prepacked cache: removed %s, left by a writer that stopped", left.describe())
        except (OSError, CacheError) as e:  # a full or read-only disk costs the next load, nothing else
            log.warning("prepacked cache: could not write %s: %s", path, e)

    def _prune(self, written: Path, facts: dict) -> None:
        """Delete the files this one supersedes: the same checkpoint path and kernel choice, made from other
        content of the checkpoint or by another quill build (never read again)."""
        build = build_id()

        def choice(f: dict) -> dict:
            return {k: v for k, v in f.get("key", {}).items() if k not in build}
        for path in self.files_dir.glob(f"*{SUFFIX}"):
            if path == written:
                continue
            try:
                old = read_header(path, verify=False).facts  # older formats too: they are superseded
            except (CacheError, OSError):
                continue  # unreadable files are for `quill cache prune`
            if old.get("source") == facts["source"] and choice(old) == choice(facts):
                path.unlink(missing_ok=True)
                log.info("prepacked cache: removed %s (superseded by %s)", path.name, written.name)

    def wait(self) -> None:
        """Wait for this cache's writes to finish (tests, benchmarks)."""
        for t in self._writers:
            t.join()
        self._writers.clear()

    def entries(self) -> list[CacheEntry]:
        """Every cache file, newest first (headers only)."""
        out = []
        for path in self.files_dir.glob(f"*{SUFFIX}"):
            try:
                f = read_header(path).facts
                out.append(CacheEntry(path, path.stat().st_size, f.get("source", "?"), f.get("model_type", "?"),
                                      ", ".join(f.get("kernels", [])), f.get("created", 0.0),
                                      str(f.get("key", {}).get("quill", "?"))))
            except (CacheError, OSError) as e:
                out.append(CacheEntry(path, path.stat().st_size, "?", "?", "", path.stat().st_mtime, "?",
                                      str(e).removeprefix(f"{path}: ")))
        return sorted(out, key=lambda e: -e.created)

    def _dirs(self) -> list[Path]:
        return [self.files_dir, self.sources_dir]

    def leftovers(self) -> list[Leftover]:
        """Temporary files of writers, running or killed (``Leftover.stale``: safe to delete)."""
        return find_leftovers(self._dirs())

    def prune(self) -> tuple[list[Path], int]:
        """Delete stale temporary files and cache files that fail their header check; (paths, bytes) removed."""
        gone = [(left.path, left.size) for left in remove_stale(self._dirs())]
        for e in self.entries():
            if e.problem is not None:
                e.path.unlink(missing_ok=True)
                gone.append((e.path, e.size))
        return [p for p, _ in gone], sum(n for _, n in gone)

    def clear(self) -> tuple[int, int]:
        """Delete every cache file, temporary file and digest record; (files, bytes) removed."""
        files = nbytes = 0
        for d in (self.files_dir, self.sources_dir):
            if not d.is_dir():
                continue
            for p in d.iterdir():
                if p.is_file():
                    nbytes += p.stat().st_size
                    p.unlink(missing_ok=True)
                    files += 1
        return files, nbytes
