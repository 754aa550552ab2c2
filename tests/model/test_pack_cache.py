"""The load cache of repacked matrices (model/pack_cache.py).

A second start of a GGUF takes every packed matrix back from the cache and
reads none of the file's quantized blocks; its logits are the first start's
bit for bit. Three files with the three ways rows move on their way from a
GGUF into a matrix: the default SmolLM2 (llama.cpp's interleaved q/k rows
undone, q|k|v and gate|up fused, the head tied to the embeddings), a tiny
Qwen3-MoE (per-expert matrices cut from 3-D tensors) and a tiny DeepSeek V3
(latent attention's rotary rows moved). A changed file, an entry cut short
and GUIDED_PACK_CACHE=off each load the same numbers.
"""
from __future__ import annotations

import logging
import os
import re
import threading

import numpy as np
import pytest
import torch

from guided import _native
from guided.model import load_model, pack_cache
from guided.model.gguf_file import GGUFFile
from guided.model.quant_linear import QuantLinear
from helpers.gguf_writer import write_gguf
from helpers.paged import last_logits
from helpers.tiny_models import VOCAB, build

pytest.importorskip("transformers")
pytestmark = pytest.mark.skipif(not _native.quant_kernels(), reason="no build of ggml's quantized kernels here")


@pytest.fixture(scope="module")
def ggufs(tmp_path_factory, default_gguf):
    made = {"smollm2": default_gguf}
    for arch in ("qwen3_moe", "deepseek_v3"):
        directory = tmp_path_factory.mktemp(arch)
        build(arch, directory)
        made[arch] = write_gguf(directory, directory / f"{arch}.gguf", "Q8_0")
    return made


class _Load:
    """load_model with the cache under `tmp_path`: the blocks read, the cache used, the logits."""

    def __init__(self, monkeypatch, tmp_path):
        self.dir = tmp_path / "packed"
        monkeypatch.setenv("GUIDED_PACK_CACHE_DIR", str(self.dir))
        monkeypatch.setattr(pack_cache, "MIN_BYTES", 0)
        self.raw: list[str] = []      # tensors whose bytes were read
        self.floats: list[str] = []   # ... of those, the ones read as floats by the file's reader
        self.caches: list[pack_cache.PackCache] = []
        raw, read, for_file = GGUFFile.raw, GGUFFile.read, pack_cache.PackCache.for_file

        def spied_raw(gguf, info):
            self.raw.append(info.name)
            return raw(gguf, info)

        def spied_read(gguf, info):
            self.floats.append(info.name)
            return read(gguf, info)

        def spied_for_file(gguf):
            cache = for_file(gguf)
            self.caches.append(cache)
            return cache
        monkeypatch.setattr(GGUFFile, "raw", spied_raw)
        monkeypatch.setattr(GGUFFile, "read", spied_read)
        monkeypatch.setattr(pack_cache.PackCache, "for_file", staticmethod(spied_for_file))

    def __call__(self, path: str, prompts: list[list[int]]):
        self.raw.clear()
        self.floats.clear()
        loaded = load_model(path, dtype="gguf")
        for writer in [t for t in threading.enumerate() if t.name == "pack-cache"]:
            writer.join()
        matrices = [m for layer in loaded.model.modules() if isinstance(layer, QuantLinear) for m in layer.matrices]
        assert matrices, "no weight stayed in its blocks"
        logits = [last_logits(loaded.model, loaded.config, ids) for ids in prompts]
        return loaded, len(matrices), logits

    def entries(self) -> list[str]:
        return sorted(p.name for p in self.dir.glob("*")) if self.dir.exists() else []


@pytest.mark.parametrize("model", ["smollm2", "qwen3_moe", "deepseek_v3"])
def test_a_second_start_reads_no_block_and_computes_the_same_bits(model, ggufs, monkeypatch, tmp_path, caplog):
    path = ggufs[model]
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB - 3, (n,), generator=gen).tolist() for n in (3, 19)]
    load = _Load(monkeypatch, tmp_path)

    monkeypatch.setenv("GUIDED_PACK_CACHE", "off")
    _, _, want = load(path, prompts)
    assert load.caches == [None] and load.entries() == []
    monkeypatch.delenv("GUIDED_PACK_CACHE")

    # the first start packs and writes the entry: a .pack and its .json
    _, count, first = load(path, prompts)
    first_cache = load.caches[-1]
    assert first_cache.taken == 0 and first_cache.packed > 0
    entry = load.entries()
    assert len(entry) == 2 and {os.path.splitext(e)[1] for e in entry} == {".pack", ".json"}
    # the tensors of the packed matrices, by the keys that name them (their rows' provenance)
    held = {name for key in first_cache.made for name in re.findall(r"[\w.]+?\.weight", key)}
    assert held and held <= set(load.raw) - set(load.floats)

    # the second takes every packed matrix back and reads no block of the file
    loaded, count_again, second = load(path, prompts)
    cache = load.caches[-1]
    assert count_again == count and cache.taken == first_cache.packed and cache.packed == 0
    assert not held & set(load.raw), f"blocks read on a hit: {sorted(held & set(load.raw))[:5]}"
    assert load.entries() == entry   # nothing written again
    for a, b, c in zip(want, first, second):
        assert torch.equal(a, b) and torch.equal(a, c)

    # a changed file misses: a new entry replaces the old one
    st = os.stat(path)
    if model == "smollm2":   # the installed default model: a copy of it, changed
        path = str(tmp_path / "copy.gguf")
        with open(ggufs[model], "rb") as src, open(path, "wb") as dst:
            dst.write(src.read())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    _, _, changed = load(path, prompts)
    assert load.caches[-1].taken == 0 and load.caches[-1].packed > 0
    assert all(torch.equal(a, b) for a, b in zip(want, changed))
    after = load.entries()
    assert len(after) == (2 if model != "smollm2" else 4) and set(after) != set(entry)

    # an entry cut short (replaced, as the cache itself only ever replaces files) packs again
    del loaded, cache
    pack = next(p for p in load.dir.glob("*.pack") if p.name not in entry)
    short = pack.with_name("short.tmp")
    short.write_bytes(pack.read_bytes()[:pack.stat().st_size // 2])
    os.replace(short, pack)
    with caplog.at_level(logging.WARNING, logger="guided.model"):
        _, _, again = load(path, prompts)
    assert "packing again" in caplog.text
    assert all(torch.equal(a, b) for a, b in zip(want, again))
    assert load.caches[-1].packed > 0


def test_a_packed_file_refuses_what_it_does_not_hold(tmp_path):
    rng = np.random.default_rng(3)
    q8 = _native.QuantMatrix.quantize(8, rng.standard_normal((16, 64), dtype=np.float32))
    q3k = _native.QuantMatrix.quantize(11, rng.standard_normal((4, 256), dtype=np.float32))
    path = tmp_path / "m.pack"
    spans = _native.PackedFile.write(path, [q8, q8])
    assert spans[1][0] % 64 == 0 and spans[0] == (0, q8.nbytes)
    f = _native.PackedFile(path)
    back = f.matrix(8, 16, 64, *spans[1])
    x = rng.standard_normal((3, 64), dtype=np.float32)
    want, got = np.zeros((3, 16), np.float32), np.zeros((3, 16), np.float32)
    q8.matmul(x, want)
    back.matmul(x, got)
    assert np.array_equal(want, got)
    with pytest.raises(ValueError, match="past the end"):
        f.matrix(8, 16, 64, spans[1][0], f.size)
    with pytest.raises(ValueError, match=r"not a packed \[17, 64\] Q8_0"):
        f.matrix(8, 17, 64, *spans[0])
    with pytest.raises(ValueError, match="Q3_K.*has no packing"):
        _native.PackedFile.write(tmp_path / "n.pack", [q8, q3k])
    with pytest.raises(OSError, match="missing.pack"):
        _native.PackedFile(tmp_path / "missing.pack")


def test_a_cache_that_cannot_be_written_leaves_the_load_as_it_was(ggufs, monkeypatch, tmp_path, caplog):
    gen = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, VOCAB - 3, (9,), generator=gen).tolist()]
    load = _Load(monkeypatch, tmp_path)
    _, _, want = load(ggufs["qwen3_moe"], prompts)
    (tmp_path / "blocked").write_text("a file where the cache's folder would be")
    monkeypatch.setenv("GUIDED_PACK_CACHE_DIR", str(tmp_path / "blocked" / "packed"))
    with caplog.at_level(logging.WARNING, logger="guided.model"):
        _, _, got = load(ggufs["qwen3_moe"], prompts)
    assert "pack cache: cannot use" in caplog.text
    assert torch.equal(want[0], got[0])
