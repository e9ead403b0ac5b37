"""Running the stages together: the RL loop, its launchers (local processes, Ray) and the torchrun relaunch."""
