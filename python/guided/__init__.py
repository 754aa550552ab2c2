"""guided: an LLM serving engine built around grammar-guided decoding."""
import os

# llguidance reports a token its grammar refuses as an anyhow error, and
# anyhow captures a backtrace for each wherever RUST_BACKTRACE is set: the
# closing search meets thousands of refusals a step (Scheduler.update 9x
# slower, a tenth of a constrained batch's time). Library backtraces stay off
# unless RUST_LIB_BACKTRACE asks for them; a panic still prints its own.
os.environ.setdefault("RUST_LIB_BACKTRACE", "0")

from .chat import ChatOptions, ChatResponse
from .llm import LLM
from .model import ModelNotFoundError
from .outputs import CompletionOutput, Logprob, RequestOutput
from .sampling_params import SamplingParams, StructuredOutputsParams

__all__ = ["LLM", "SamplingParams", "StructuredOutputsParams", "RequestOutput", "CompletionOutput",
           "Logprob", "ChatOptions", "ChatResponse", "ModelNotFoundError"]
__version__ = "0.2.0"
