"""`python -m guided.serve`: the OpenAI-compatible HTTP server."""
