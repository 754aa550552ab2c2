"""Unpack ggml's sources for rust/build.rs: `python3 rust/ggml_sources.py DEST`.

ggml comes from llama-cpp-python's sdist on PyPI (pinned by version and
sha256), which vendors llama.cpp whole; only its ggml/ directory is kept,
as DEST/ggml. The sdist is kept in the user's cache
($XDG_CACHE_HOME/guided, else ~/.cache/guided), so a second build, or the
same build in another target directory, does not download it again.
Standard library only: build.rs runs it with the build's Python.
"""
from __future__ import annotations

import hashlib
import io
import os
import shutil
import sys
import tarfile
import urllib.request
from pathlib import Path

VERSION = "0.3.36"
URL = ("https://files.pythonhosted.org/packages/ec/e9/"
       "e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
       f"llama_cpp_python-{VERSION}.tar.gz")
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PREFIX = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/ggml/"


def cached_sdist() -> bytes:
    """The pinned sdist's bytes: from the cache when it holds them intact,
    else downloaded, checked and cached."""
    home = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "guided"
    path = home / f"llama_cpp_python-{VERSION}.tar.gz"
    if path.exists():
        data = path.read_bytes()
        if hashlib.sha256(data).hexdigest() == SHA256:
            return data
    print(f"downloading ggml's sources (llama-cpp-python {VERSION} sdist, PyPI)", file=sys.stderr, flush=True)
    with urllib.request.urlopen(URL, timeout=300) as response:
        data = response.read()
    digest = hashlib.sha256(data).hexdigest()
    if digest != SHA256:
        sys.exit(f"{URL}: sha256 {digest}, expected {SHA256}")
    try:
        home.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.part")
        partial.write_bytes(data)
        partial.replace(path)
    except OSError as e:   # a read-only home still builds
        print(f"not cached ({e})", file=sys.stderr)
    return data


def main(dest: Path) -> None:
    data = cached_sdist()
    target = dest / "ggml"
    shutil.rmtree(target, ignore_errors=True)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        members = [m for m in tar.getmembers() if m.name.startswith(PREFIX) and (m.isfile() or m.isdir())]
        for m in members:
            m.name = "ggml/" + m.name[len(PREFIX):]
        tar.extractall(dest, members=members, filter="data")
    print(f"ggml's sources in {target}", file=sys.stderr)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
