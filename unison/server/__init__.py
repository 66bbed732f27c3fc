"""The OpenAI-compatible HTTP server: a launcher that owns the core, and N attached workers."""
