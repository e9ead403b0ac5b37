"""The rollout stage: prompts in, scored samples out as rollouts/N (plus eval, import and buffer sources)."""
