"""``slimectl status``: the run at a glance."""

from __future__ import annotations

import click

from slimectl.commands._options import resolve_run_dir, run_dir_option


@click.command("status", short_help="Show a run's config, artifacts, engines and metrics.")
@run_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print machine-readable JSON.")
@click.option("--no-probe", is_flag=True, help="Do not contact engines for their health.")
@click.option("--timeout", default=1.0, show_default=True, help="Seconds to wait for each engine's /health.")
@click.pass_context
def status_cmd(ctx: click.Context, run_dir: str | None, as_json: bool, no_probe: bool, timeout: float) -> None:
    """Print the run at a glance: config summary, latest checkpoint, weight versions,
    rollouts produced and consumed, engines with their health, running stages, last metrics."""
    from slimectl.contract.rundir import RunDir
    from slimectl.stages.status import collect_status, format_status, status_json

    run = RunDir.open(resolve_run_dir(ctx, run_dir))
    st = collect_status(run, probe=not no_probe, timeout=timeout)
    click.echo(status_json(st) if as_json else format_status(st))
