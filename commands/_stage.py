"""What every stage command does first: open the run, resolve its config, honour --dry-run."""

from __future__ import annotations

import click

from slimectl.commands._options import resolve_run_dir


def open_stage(ctx: click.Context, stage: str, run_dir: str | None, overrides: tuple[str, ...] | list[str],
               dry_run: bool):
    """Return (run, config) for ``stage`` with its --set overrides, having saved the effective config
    under RUN/configs/STAGE.yaml — or None after printing the config when ``dry_run``. The run's
    length is the one ``slimectl extend`` recorded, unless this invocation sets it."""
    from slimectl.contract.rundir import RunDir

    run = RunDir.open(resolve_run_dir(ctx, run_dir))
    cfg = run.stage_config(stage, list(overrides))
    if dry_run:
        click.echo(cfg.to_yaml(), nl=False)
        return None
    run.save_stage_config(stage, cfg)
    from slimectl.contract.metrics import configure_wandb

    configure_wandb(cfg, run.path)  # logging.wandb: this stage's metrics go to W&B too
    return run, cfg


def format_ids(ids: list[int]) -> str:
    """``[0, 1, 2, 3, 7]`` -> ``0-3, 7``: runs of consecutive ids collapsed."""
    if not ids:
        return "none"
    parts, start, prev = [], ids[0], ids[0]
    for i in list(ids[1:]) + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)
