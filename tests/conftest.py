"""Shared fixtures: the default model loaded once per test session."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

torch.set_num_threads(max(1, os.cpu_count() or 1))

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # tests/families.py


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


@pytest.fixture(scope="session")
def family_root(tmp_path_factory, default_gguf):
    """Where the chat-family test models are built (see tests/families.py)."""
    import families
    if not families.TEMPLATES.is_dir():
        pytest.skip(f"the family templates are in {families.TEMPLATES}, which is absent")
    root = tmp_path_factory.mktemp("families")
    families.save_weights(default_gguf, root / "weights.safetensors")
    return root


_FAMILY_LLM: dict = {}


@pytest.fixture
def family_llm(family_root, default_gguf):
    """family name → an LLM of that family (one alive at a time: they are big)."""
    import families
    from guided import LLM

    def get(name: str):
        if name not in _FAMILY_LLM:
            _FAMILY_LLM.clear()
            family = families.BY_NAME[name]
            path = default_gguf if family.template is None else \
                families.build(family, default_gguf, family_root, family_root / "weights.safetensors")
            _FAMILY_LLM[name] = LLM(path, max_num_seqs=24, kv_cache_tokens=24576)
        return _FAMILY_LLM[name]
    return get
