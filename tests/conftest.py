"""Shared fixtures: the default model loaded once per test session."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, os.cpu_count() or 1))

SHARED = Path(__file__).resolve().parents[1].parent / "shared"


@pytest.fixture(scope="session")
def default_gguf() -> str:
    from guided.model import default_model_path
    return str(default_model_path())


@pytest.fixture(scope="session")
def llm():
    """The default model in fp32 (exact parity with transformers) with a small
    KV pool, shared by tests that need no special engine settings; they must
    leave it idle when done."""
    from guided import LLM
    return LLM(dtype="float32", max_num_seqs=32, kv_cache_tokens=16384)


@pytest.fixture(scope="session")
def hf_default(default_gguf):
    """transformers' own load of the same GGUF, fp32 on CPU: the reference."""
    transformers = pytest.importorskip("transformers")
    path = Path(default_gguf)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    return model.eval(), tok
