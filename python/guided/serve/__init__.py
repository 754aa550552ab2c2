"""`python -m guided.serve` (the OpenAI-compatible server is a later issue)."""
