"""HTTP plumbing shared by the servers (engine, harness, rollout buffer)."""
