"""llama.cpp's own sources, as vendored in the ``llama-cpp-python`` 0.3.36 sdist: its HF -> GGUF converter.

Tests and benchmarks write GGUF files of new architectures the way users get them: a transformers
checkpoint through ``convert_hf_to_gguf.py`` (this module), then llama.cpp's quantizer
(``quill.bench.llamacpp.quantize_with_llamacpp``).  The sdist comes from PyPI once, checked against its
sha256, and only the converter (``convert_hf_to_gguf.py``, ``conversion/``, ``gguf-py/``) is unpacked,
into ``~/.cache/quill/llama-cpp-python-0.3.36`` (``QUILL_LLAMACPP_SRC`` overrides the folder).  The
converter runs in a subprocess of the given interpreter (it needs torch, transformers, numpy,
sentencepiece: quill's test environment has them), never in quill's own process.

    python -m quill.bench.llamacpp_src CHECKPOINT_DIR OUT.gguf [--outtype f32]
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import re
import subprocess
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
INDEX = "https://pypi.org/simple/llama-cpp-python/"
# what the converter needs of the sdist, under vendor/llama.cpp/
CONVERTER_PARTS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


class ConverterUnavailable(RuntimeError):
    """The sdist could not be fetched or unpacked (no network to PyPI, a checksum mismatch)."""


def source_dir() -> Path:
    default = Path.home() / ".cache" / "quill" / f"llama-cpp-python-{VERSION}"
    return Path(os.environ.get("QUILL_LLAMACPP_SRC", default))


def _sdist_url() -> str:
    page = urllib.request.urlopen(INDEX, timeout=60).read().decode()
    for href in re.findall(r'href="([^"]+)"', page):
        if href.split("#")[0].endswith("/" + SDIST):
            return href.split("#")[0]
    raise ConverterUnavailable(f"{SDIST} is not listed at {INDEX}")


def _download(dst: Path) -> None:
    url = _sdist_url()
    data = urllib.request.urlopen(url, timeout=300).read()
    got = hashlib.sha256(data).hexdigest()
    if got != SHA256:
        raise ConverterUnavailable(f"{url}: sha256 {got}, expected {SHA256}")
    dst.write_bytes(data)


def vendored_llamacpp() -> Path:
    """``vendor/llama.cpp`` with the converter unpacked (fetched once; later calls only look)."""
    root = source_dir()
    llama = root / "vendor" / "llama.cpp"
    done = root / ".unpacked"
    if done.exists():
        return llama
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:  # parallel test workers: one fetches, the others wait for it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            _unpack(root)
    return llama


def _unpack(root: Path) -> None:
    archive = root / SDIST
    try:
        if not archive.exists():
            _download(archive)
        prefix = f"llama_cpp_python-{VERSION}/"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers()
                       if any(m.name.startswith(prefix + "vendor/llama.cpp/" + p) for p in CONVERTER_PARTS)]
            for m in members:
                m.name = m.name[len(prefix):]
            tar.extractall(root, members=members, filter="data")
    except (OSError, tarfile.TarError) as e:
        raise ConverterUnavailable(f"llama.cpp's converter from {SDIST}: {e}") from e
    archive.unlink()
    (root / ".unpacked").touch()


def convert_hf_to_gguf(checkpoint: Path, out: Path, outtype: str = "f32", python: str = sys.executable,
                       extra: tuple[str, ...] = ()) -> Path:
    """``convert_hf_to_gguf.py CHECKPOINT --outfile OUT --outtype OUTTYPE [EXTRA...]`` (outtype f32, f16, bf16,
    q8_0; ``extra`` e.g. ``("--no-mtp",)`` for a Qwen3.5 checkpoint without its multi-token-prediction layer)."""
    llama = vendored_llamacpp()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(llama / "gguf-py"), str(llama)]),
               NO_LOCAL_GGUF="")
    cmd = [python, str(llama / "convert_hf_to_gguf.py"), str(checkpoint), "--outfile", str(out),
           "--outtype", outtype, *extra]
    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if run.returncode != 0:
        raise RuntimeError(f"convert_hf_to_gguf.py {checkpoint} failed ({run.returncode}):\n{run.stderr[-4000:]}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--outtype", default="f32")
    args, extra = ap.parse_known_args(argv)  # the rest goes to the converter as is (e.g. --no-mtp)
    print(convert_hf_to_gguf(args.checkpoint, args.out, args.outtype, extra=tuple(extra)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
