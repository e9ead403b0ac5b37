"""Real SGLang servers: their launch specs and argv check, and launching them and the router (GPU clusters)."""
