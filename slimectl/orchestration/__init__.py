"""Running the stages together: the RL loop and its launchers (local processes, Ray)."""
