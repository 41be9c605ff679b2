"""The OpenAI-compatible HTTP API on Litestar: protocol structs, validation, SSE, errors, metrics."""
