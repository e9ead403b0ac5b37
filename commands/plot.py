"""``slimectl plot``: reward, response length, KL and step time of a run, as a PNG and a text curve."""

from __future__ import annotations

import click

from slimectl.commands._options import resolve_run_dir, run_dir_option


@click.command("plot", short_help="Plot reward, length, KL and step time of a run (PNG + text).")
@run_dir_option
@click.option("-o", "--out", type=click.Path(dir_okay=False), help="PNG path (default: RUN/plots/curves.png).")
@click.pass_context
def plot_cmd(ctx: click.Context, run_dir: str | None, out: str | None) -> None:
    """Print the reward curve (mean reward over ten spans of rollouts) and write a PNG of the
    reward, response length, KL and step time. Prints the PNG path last.

    \b
    Example:
      slimectl plot -r runs/demo
    """
    from slimectl.stages.plot import first_last_gain, plot_run, reward_table
    from slimectl.contract.rundir import RunDir

    run = RunDir.open(resolve_run_dir(ctx, run_dir))
    path, curves = plot_run(run, out)
    click.echo(reward_table(curves.reward))
    first, last = first_last_gain(curves.reward)
    click.echo(f"mean reward: first 20% of rollouts {first:.3f}, last 20% {last:.3f} ({last - first:+.3f})")
    click.echo(str(path))
