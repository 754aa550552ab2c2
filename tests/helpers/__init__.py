"""What the tests share: the peers' data beside the checkout (``SHARED``),
the chat-family test models (families; family_model: a tiny GGUF of a
family's own architecture, gpt-oss or LFM2, with its own template), a live server (live_server), the
JSON Schema reference checks (json_schema), the tool-calling data (tools),
the default model's prompts (prompts) and the structured-output suites'
validator and JSONSchemaBench sample (structured)."""
from __future__ import annotations

from pathlib import Path

#: ../shared beside the checkout: JSONSchemaBench and the chat templates.
#: Tests that need it skip with a reason where a clone has none.
SHARED = Path(__file__).resolve().parents[2].parent / "shared"
