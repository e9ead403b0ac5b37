"""Agent workflows: multi-turn tool rollouts, the sandboxed tools, the OpenAI-compatible agent harness."""
