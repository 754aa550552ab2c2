"""A GGUF's repacked matrices kept between starts.

Every start repacks a GGUF's blocks for the multi-row kernels
(rust/cpu/packed.rs): about 1.5 s of a Qwen2.5-Coder 1.5B's load on two
cores, after reading the 1 GB of blocks. The cache keeps what a load packed,
one entry per model under ``cache_dir()/packed``, and the next load takes
each matrix back (``QuantMatrix.from_packed``) without reading or packing
its blocks: the same bytes, so the same products bit for bit.

An entry is named by the GGUF and the code that packed it: the file's real
path, size, modification time and header (metadata and tensor table), and a
hash of the native module and of this package's loading code. A changed
file or a rebuilt engine misses and writes a new entry in place of the old.
Within an entry each matrix is named by its rows' provenance
(``QuantWeight.key``: the tensors and the row moves that made it), with its
format and shape checked on the way back.

Entries are written (a temporary file, then renamed: a crash leaves none)
only for models whose packed matrices reach ``MIN_BYTES``; smaller ones
pack faster than a cache pays. Writing an entry removes those of files that
are gone and older ones of the same file. ``GUIDED_PACK_CACHE=off`` turns
the cache off; ``GUIDED_PACK_CACHE_DIR`` puts it elsewhere (the test suite's
is a folder of its own, removed at the end).
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from .. import _native

if TYPE_CHECKING:
    from .gguf_file import GGUFFile
    from .quant_linear import QuantWeight

log = logging.getLogger("guided.model")

#: models whose packed matrices are smaller are not written (they pack in milliseconds)
MIN_BYTES = 64 << 20
_FORMAT = "guided-pack-cache 1"
_KEEP_FREE = 1 << 30   # an entry is not written where it would leave less free on the disk
_WRITING: set[Path] = set()   # entries a thread of this process is writing
_WRITING_LOCK = threading.Lock()


def enabled() -> bool:
    return os.environ.get("GUIDED_PACK_CACHE", "on").lower() not in ("0", "off", "false", "no")


@functools.cache
def _code_digest() -> str:
    """The native module's bytes and the loading code's sources: a rebuilt or edited engine misses."""
    h = hashlib.sha256(_FORMAT.encode())
    here = Path(__file__).parent
    for path in [Path(_native.__file__), *sorted(here.glob("*.py"))]:
        h.update(path.name.encode())
        h.update(path.read_bytes())
    return h.hexdigest()


class PackCache:
    """One GGUF's entry: matrices taken back by `get`, and every matrix the load made
    (`add`), written by `save` where this load packed some."""

    def __init__(self, gguf: GGUFFile, directory: str | os.PathLike, min_bytes: int = MIN_BYTES):
        self.source = os.path.realpath(gguf.path)
        st = os.stat(self.source)
        h = hashlib.sha256(_code_digest().encode())
        h.update(f"{self.source}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        h.update(gguf.header())
        self.dir = Path(directory)
        name = f"{Path(self.source).stem}-{h.hexdigest()[:20]}"
        self.pack, self.entry = self.dir / f"{name}.pack", self.dir / f"{name}.json"
        self.min_bytes = min_bytes
        self.index: dict[str, list[int]] = {}    # key → [ggml_type, rows, cols, offset, nbytes]
        self._file: _native.PackedFile | None = None
        self.made: dict[str, tuple[int, _native.QuantMatrix]] = {}   # key → (ggml_type, matrix)
        self.taken = self.packed = 0   # matrices taken back; matrices this load packed
        try:
            self.index = json.loads(self.entry.read_text())["matrices"]
            self._file = _native.PackedFile(self.pack)
        except (OSError, ValueError, KeyError):
            self.index = {}

    @staticmethod
    def for_file(gguf: GGUFFile) -> PackCache | None:
        """The cache's entry for `gguf`, in GUIDED_PACK_CACHE_DIR, else `cache_dir()/packed`
        (None where GUIDED_PACK_CACHE turns the cache off)."""
        if not enabled():
            return None
        from ..models import cache_dir
        directory = os.environ.get("GUIDED_PACK_CACHE_DIR") or Path(cache_dir()) / "packed"
        return PackCache(gguf, directory, MIN_BYTES)

    def get(self, weight: QuantWeight) -> _native.QuantMatrix | None:
        """`weight`'s matrix as an earlier load packed it, or None (not there, or not the same shape)."""
        found = self.index.get(weight.key)
        if found is None or self._file is None or found[:3] != [weight.ggml_type, weight.shape[0], weight.cols]:
            return None
        try:
            m = self._file.matrix(*found)
        except ValueError as e:   # an entry cut short or written by other code: pack again
            log.warning("pack cache %s: %s (packing again)", self.pack, e)
            return None
        self.taken += 1
        self.made[weight.key] = found[0], m
        return m

    def add(self, weight: QuantWeight, matrix: _native.QuantMatrix) -> None:
        if matrix.packed:   # (Q2_K and Q3_K keep ggml's rows: nothing to keep)
            self.made[weight.key] = weight.ggml_type, matrix
            self.packed += 1

    def save(self) -> threading.Thread | None:
        """Where this load packed matrices it did not find, and the model is large enough to
        pay: write the entry on a thread of its own (returned; the load does not wait for the
        disk), then remove stale entries: of this file, or of files now gone."""
        if self.taken:
            log.info("pack cache: took %d matrices of %s from %s", self.taken, self.source, self.pack)
        total = sum(m.nbytes for _, m in self.made.values())
        if not self.packed or total < self.min_bytes:
            return None
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            free = shutil.disk_usage(self.dir).free
        except OSError as e:   # a read-only home: the model runs all the same
            log.warning("pack cache: cannot use %s: %s", self.dir, e)
            return None
        if free < total + _KEEP_FREE:
            log.warning("pack cache: %.0f MB free in %s, not writing %.0f MB", free / 1e6, self.dir, total / 1e6)
            return None
        with _WRITING_LOCK:
            if self.pack in _WRITING:   # another load in this process is writing it
                return None
            _WRITING.add(self.pack)
        writer = threading.Thread(target=self._write, args=(dict(self.made), total), name="pack-cache")
        writer.start()
        return writer

    def _write(self, made: dict[str, tuple[int, _native.QuantMatrix]], total: int) -> None:
        try:
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            os.close(fd)
            try:
                spans = _native.PackedFile.write(tmp, [m for _, m in made.values()])   # and synced
                os.replace(tmp, self.pack)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
            index = {key: [ty, m.rows, m.cols, *span] for (key, (ty, m)), span in zip(made.items(), spans)}
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"source": self.source, "matrices": index}, f)
            os.replace(tmp, self.entry)
            log.info("pack cache: wrote %d matrices (%.0f MB) of %s", len(made), total / 1e6, self.source)
            self._remove_stale()
        except OSError as e:   # a full or read-only disk: the model runs all the same
            log.warning("pack cache: could not write %s: %s", self.pack, e)
        finally:
            with _WRITING_LOCK:
                _WRITING.discard(self.pack)

    def _remove_stale(self) -> None:
        for left in self.dir.glob("*.tmp"):   # a writer killed halfway, an hour ago or more
            if time.time() - left.stat().st_mtime > 3600:
                left.unlink(missing_ok=True)
        for entry in self.dir.glob("*.json"):
            if entry == self.entry:
                continue
            try:
                source = json.loads(entry.read_text()).get("source")
            except (OSError, ValueError):
                source = None
            if source == self.source or source is None or not os.path.exists(source):
                for stale in (entry, entry.parent / f"{entry.stem}.pack"):
                    stale.unlink(missing_ok=True)
