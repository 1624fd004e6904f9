"""A checkpoint's content digest, computed once and remembered by the files' identity.

The digest is XXH3-128 over every file of the checkpoint (a ``.gguf`` file, or a directory's
weights, configs and tokenizer files: names, sizes, bytes), ~10 GB/s from the page cache.  It is stored in
``<cache>/sources/`` beside the files' fingerprint (path, size, modification time in ns,
inode); a later load whose fingerprint matches reuses it without reading the checkpoint, and
any change to a file (rewritten, replaced, touched) changes the fingerprint and so recomputes
the digest: a changed checkpoint never meets a cache entry built from its old content.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import xxhash

from quill.prepacked.leftovers import temp_path

_CHUNK = 16 << 20


# What a checkpoint directory's readers open (weights, configs, tokenizer files, chat templates); other files
# there (a Hub snapshot's original/*.pth, README, images) cannot change a load and are not digested.
SOURCE_SUFFIXES = (".safetensors", ".json", ".gguf", ".model", ".jinja", ".txt", ".tiktoken")


def source_files(path: Path) -> list[Path]:
    """The files a checkpoint consists of: itself, or the directory's own files that loading reads."""
    if path.is_file():
        return [path]
    return sorted(p for p in path.iterdir()
                  if p.is_file() and p.suffix in SOURCE_SUFFIXES and not p.name.startswith("."))


def fingerprint(path: Path) -> list[list]:
    """[[relative name, size, mtime_ns, inode], ...] of the checkpoint's files (cheap: stat only)."""
    base = path if path.is_dir() else path.parent
    out = []
    for f in source_files(path):
        st = f.stat()
        out.append([str(f.relative_to(base)), st.st_size, st.st_mtime_ns, st.st_ino])
    return out


def content_digest(path: Path) -> str:
    """XXH3-128 (hex) of the checkpoint's file names, sizes and bytes."""
    base = path if path.is_dir() else path.parent
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    for f in source_files(path):
        h.update(str(f.relative_to(base)).encode() + b"\0" + struct.pack("<Q", f.stat().st_size))
        with open(f, "rb", buffering=0) as fh:
            while n := fh.readinto(buf):
                h.update(view[:n])
    return h.hexdigest()


def digest(path: Path, sources_dir: Path) -> str:
    """The content digest of checkpoint ``path``, from ``sources_dir``'s record when the files are unchanged."""
    path = path.resolve()
    record_path = sources_dir / f"{xxhash.xxh3_64(str(path).encode()).hexdigest()}.json"
    fp = fingerprint(path)
    try:
        record = json.loads(record_path.read_text())
        if record.get("path") == str(path) and record.get("files") == fp and isinstance(record.get("digest"), str):
            return record["digest"]
    except (OSError, ValueError):
        pass  # no record yet, or an unreadable one: compute and (re)write it
    value = content_digest(path)
    if fingerprint(path) == fp:  # unchanged while it was read: remember it
        _write_atomic(record_path, json.dumps({"path": str(path), "files": fp, "digest": value}))
    return value


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = temp_path(path)
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)  # a read-only or full cache directory only costs the next load a digest
