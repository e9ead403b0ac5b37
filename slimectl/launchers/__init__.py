"""Launchers that place ``slimectl rl``'s engines and trainer on existing distributed engines.

The default launcher (:class:`slimectl.rl.LocalLauncher`: child processes, the trainer in the
driver) needs nothing extra. :mod:`slimectl.launchers.ray_launcher` places them as Ray actors;
Ray is an optional extra (``pip install 'slimectl[ray]'``) imported only when that launcher runs.
"""
