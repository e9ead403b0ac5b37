"""``slimectl inspect``: read run-directory artifacts in a human-friendly form."""

from __future__ import annotations

import click

from slimectl.commands._options import resolve_run_dir, run_dir_option


@click.group("inspect", short_help="Show artifacts of a run readably (rollouts, ...).")
def inspect_cmd() -> None:
    """Show artifacts of a run in readable form."""


@inspect_cmd.command("rollout")
@run_dir_option
@click.argument("rollout_id", type=click.IntRange(min=0))
@click.option("--limit", default=8, show_default=True, help="Samples to show (0: all).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per sample.")
@click.pass_context
def inspect_rollout_cmd(ctx: click.Context, run_dir: str | None, rollout_id: int, limit: int, as_json: bool) -> None:
    """Print the samples of rollouts/ROLLOUT_ID: prompt, response, reward, log-prob summary."""
    from slimectl.stages.rollout.inspect import format_samples, load_rollout_samples
    from slimectl.contract.rundir import RunDir

    run = RunDir.open(resolve_run_dir(ctx, run_dir))
    art, samples = load_rollout_samples(run, rollout_id)
    click.echo(format_samples(art, samples, limit=limit, as_json=as_json))
