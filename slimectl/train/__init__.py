"""Training side (Megatron): packing rollout samples into micro-batches and computing log-probs."""
