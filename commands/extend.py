"""``slimectl extend``: change a run's length (``rollout.num_rollout``) for every stage."""

from __future__ import annotations

import click

from slimectl.commands._options import resolve_run_dir, run_dir_option


@click.command("extend", short_help="Change how many rollouts a run has (rollout.num_rollout), for every stage.")
@run_dir_option
@click.option("--num-rollout", "num_rollout", required=True, type=click.IntRange(min=1), metavar="N",
              help="The run's new total number of rollouts (not below what is already produced or trained).")
@click.pass_context
def extend_cmd(ctx: click.Context, run_dir: str | None, num_rollout: int) -> None:
    """Record a new rollout.num_rollout in RUN/extend.json (atomically); rollout, train, rl and
    status read it from then on (a --set rollout.num_rollout of one invocation still wins for it).
    Works at any point of the run; a running `rl` or `train --follow` sees it when restarted.

    \b
    Examples:
      slimectl extend -r runs/a --num-rollout 500
      slimectl extend -r runs/a --num-rollout 20 && slimectl rl -r runs/a
    """
    from slimectl.contract.rundir import RunDir
    from slimectl.stages.extend import extend_run

    run = RunDir.open(resolve_run_dir(ctx, run_dir))
    res = extend_run(run, num_rollout)
    if not res.changed:
        click.echo(f"{run.path}: already {res.num_rollout} rollouts; nothing changed")
        return
    click.echo(f"{run.path}: {res.previous} -> {res.num_rollout} rollouts ({res.produced} produced, "
               f"{res.trained} trained); go on with `slimectl rl -r {run.path}`")
