"""``python -m slimectl``: the same entry point as the ``slimectl`` console script."""

from slimectl.commands.cli import main

if __name__ == "__main__":
    main()
