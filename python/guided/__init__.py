"""guided: an LLM serving engine built around grammar-guided decoding."""
from .chat import ChatOptions, ChatResponse
from .llm import LLM
from .model import ModelNotFoundError
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "Logprob", "ChatOptions", "ChatResponse", "ModelNotFoundError"]
__version__ = "0.2.0"
