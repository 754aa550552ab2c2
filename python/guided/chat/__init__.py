"""The chat layer: templates, tool formats, the chat grammar, output parsing."""
from .parser import ChatDelta, ChatResponse
from .request import ChatOptions, ChatPlan, prepare_chat
from .template import render_chat

__all__ = ["ChatDelta", "ChatOptions", "ChatPlan", "ChatResponse", "prepare_chat", "render_chat"]
