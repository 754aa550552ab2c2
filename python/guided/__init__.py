"""guided: an LLM serving engine built around grammar-guided decoding."""
from .llm import LLM, ChatResponse
from .model import ModelNotFoundError
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "ChatResponse", "ModelNotFoundError"]
__version__ = "0.1.0"
