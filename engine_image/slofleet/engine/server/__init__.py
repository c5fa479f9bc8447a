"""The HTTP server around the engine core: OpenAI-compatible API, metrics, lifecycle."""
