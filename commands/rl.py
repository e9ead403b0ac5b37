"""``slimectl rl``: every stage together, in one process tree."""

from __future__ import annotations

import click

from slimectl.commands._options import dry_run_option, overrides_option, resolve_run_dir, run_dir_option


@click.command("rl", short_help="Run the whole loop: serve, rollout, train, sync, repeat.")
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False), help="YAML config file.")
@run_dir_option
@overrides_option
@dry_run_option
@click.pass_context
def rl_cmd(ctx: click.Context, config_path: str | None, run_dir: str | None, overrides: tuple[str, ...],
           dry_run: bool) -> None:
    """Run rollout -> train -> sync for every rollout id, resuming from the run directory.

    \b
    Example:
      slimectl rl --config examples/cpu_demo.yaml -r runs/demo
    """
    from slimectl.errors import NotAvailableYet, UsageError
    from slimectl.init_run import resolve_init_config

    if config_path is None and resolve_run_dir(ctx, run_dir) is None:
        raise UsageError("pass --config CFG (and -r RUN), or -r RUN of an initialized run")
    if dry_run:
        if config_path is not None:
            cfg = resolve_init_config(config_path, overrides)
        else:
            from slimectl.rundir import RunDir

            cfg = RunDir.open(resolve_run_dir(ctx, run_dir)).stage_config("rl", overrides)
        click.echo(cfg.to_yaml(), nl=False)
        return
    raise NotAvailableYet(
        "`slimectl rl` is not available yet in this release (tracked in issue #7); "
        "`slimectl init` and `slimectl status` work today"
    )
