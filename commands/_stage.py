"""Helpers for stage commands whose implementation lands in a later release."""

from __future__ import annotations

import click

from slimectl.commands._options import resolve_run_dir


def stage_config_or_unavailable(ctx: click.Context, stage: str, run_dir: str | None, overrides: tuple[str, ...],
                                dry_run: bool, issue: int) -> None:
    """Resolve the stage's config (so --set and --dry-run already work), then say it is not available."""
    from slimectl.errors import NotAvailableYet
    from slimectl.rundir import RunDir

    run = RunDir.open(resolve_run_dir(ctx, run_dir))
    cfg = run.stage_config(stage, overrides)
    if dry_run:
        click.echo(cfg.to_yaml(), nl=False)
        return
    raise NotAvailableYet(
        f"`slimectl {stage}` is not available yet in this release (tracked in issue #{issue}); "
        f"--dry-run shows the config it would use"
    )
