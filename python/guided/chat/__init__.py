"""Chat-template rendering (and, later, output parsing)."""
from .template import render_chat

__all__ = ["render_chat"]
