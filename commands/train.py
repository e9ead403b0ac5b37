"""``slimectl train``: Train the Megatron actor on READY rollouts, each exactly once."""

from __future__ import annotations

import click

from slimectl.commands._options import stage_options
from slimectl.commands._stage import stage_config_or_unavailable


@click.command("train", short_help="Train the Megatron actor on READY rollouts, each exactly once.")
@stage_options
@click.pass_context
def train_cmd(ctx: click.Context, run_dir: str | None, overrides: tuple[str, ...], dry_run: bool) -> None:
    """Train the Megatron actor on READY rollouts, each exactly once.

    Reads the run's frozen config; --set may override this stage's own sections.
    """
    stage_config_or_unavailable(ctx, "train", run_dir, overrides, dry_run, issue=6)
