"""Rollout stage: generation and reward computation (never imports slimectl.train)."""
