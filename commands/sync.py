"""``slimectl sync``: Push published weights to every registered engine."""

from __future__ import annotations

import click

from slimectl.commands._options import stage_options
from slimectl.commands._stage import stage_config_or_unavailable


@click.command("sync", short_help="Push published weights to every registered engine.")
@stage_options
@click.pass_context
def sync_cmd(ctx: click.Context, run_dir: str | None, overrides: tuple[str, ...], dry_run: bool) -> None:
    """Push published weights to every registered engine.

    Reads the run's frozen config; --set may override this stage's own sections.
    """
    stage_config_or_unavailable(ctx, "sync", run_dir, overrides, dry_run, issue=7)
