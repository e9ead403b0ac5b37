"""Real SGLang servers: launching, supervising and routing them (GPU clusters)."""
