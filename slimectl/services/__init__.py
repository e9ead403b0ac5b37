"""Long-running services beside the stages: the rollout buffer."""
