"""slimectl's click commands: thin adapters over the library, one module per stage.

This folder is installed as ``slimectl.commands``. Modules here import only click and
light library modules at import time, so ``slimectl --help`` never imports torch.
"""
