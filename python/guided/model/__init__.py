"""Model layer: config, loaders (GGUF, HF safetensors), the torch decoder over a
paged KV cache, and the model runner (the only place that knows the device)."""
from .attention import AttentionMetadata
from .config import ModelConfig
from .decoder import CausalLM, allocate_kv_cache
from .loader import LoadedModel, ModelNotFoundError, default_model_path, load_model
from .runner import ModelRunner

__all__ = ["AttentionMetadata", "CausalLM", "LoadedModel", "ModelConfig", "ModelNotFoundError",
           "ModelRunner", "allocate_kv_cache", "default_model_path", "load_model"]
