"""The stages, one module or package each: init, convert, export, serve, rollout, train, sync, status, plot."""
