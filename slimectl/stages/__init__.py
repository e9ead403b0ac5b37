"""The stages, one module or package each: init, convert, serve, rollout, train, sync, status, plot."""
