"""Prompts for the default model (SmolLM2, ChatML) that several test files run."""
from __future__ import annotations


def chat(text: str) -> str:
    """``text`` as the default model's user turn, the assistant's turn opened."""
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


#: two chat turns and a plain continuation: greedy parity with transformers, tensor parallelism
PROMPTS = [
    chat("What is the capital of France?"),
    chat("Write a Python function that reverses a string."),
    "Once upon a time, in a small village by the sea,",
]
