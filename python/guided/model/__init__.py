"""Model layer: config, loaders (GGUF, HF safetensors) and the torch decoder over a paged KV cache."""
from .attention import AttentionMetadata
from .config import ModelConfig
from .llama import CausalLM, allocate_kv_cache
from .loader import LoadedModel, ModelNotFoundError, default_model_path, load_model

__all__ = ["AttentionMetadata", "CausalLM", "LoadedModel", "ModelConfig", "ModelNotFoundError",
           "allocate_kv_cache", "default_model_path", "load_model"]
