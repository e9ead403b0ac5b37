"""The contract every part shares: errors, the typed config, samples, the run directory, metrics and stage logs."""
