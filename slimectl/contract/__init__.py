"""The contract every part shares: errors, the typed config and its loader, dataset specs, import-by-path, samples, the run directory, metrics and stage logs."""
