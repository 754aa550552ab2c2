"""guided: an LLM serving engine built around grammar-guided decoding."""
from .chat import ChatOptions, ChatResponse
from .llm import LLM
from .model import ModelNotFoundError
from .outputs import RequestOutput
from .sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "ChatOptions", "ChatResponse",
           "ModelNotFoundError"]
__version__ = "0.1.0"
