"""The embedded engine: our own SGLang-protocol HTTP server over a transformers model (the CPU default)."""
