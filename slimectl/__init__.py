"""slimectl: RL post-training of LLMs in stages that share one run directory.

The library (this package, minus ``slimectl.commands``) never imports click or the CLI;
every stage is a plain function that also works from Python.
"""

__version__ = "0.1.0"
