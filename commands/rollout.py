"""``slimectl rollout``: Generate and score one rollout into the run directory."""

from __future__ import annotations

import click

from slimectl.commands._options import stage_options
from slimectl.commands._stage import stage_config_or_unavailable


@click.command("rollout", short_help="Generate and score one rollout into the run directory.")
@stage_options
@click.pass_context
def rollout_cmd(ctx: click.Context, run_dir: str | None, overrides: tuple[str, ...], dry_run: bool) -> None:
    """Generate and score one rollout into the run directory.

    Reads the run's frozen config; --set may override this stage's own sections.
    """
    stage_config_or_unavailable(ctx, "rollout", run_dir, overrides, dry_run, issue=5)
