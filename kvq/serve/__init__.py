"""`kvq serve`: the runtime engine behind an OpenAI-compatible HTTP API (completions, chat, streaming)."""
