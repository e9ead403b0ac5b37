"""``slimectl rollout``: generate and score one rollout into the run directory."""

from __future__ import annotations

import click

from slimectl.commands._options import engine_urls_option, force_option, stage_options


@click.group("rollout", invoke_without_command=True, short_help="Generate and score one rollout into the run directory.")
@stage_options
@click.option("--id", "rollout_id", type=click.IntRange(min=0), help="Rollout id to produce.")
@click.option("--next", "next_", is_flag=True, help="Produce the next rollout id (the default).")
@engine_urls_option
@click.option("--skip-bad-rows", is_flag=True, default=None, help="Skip (and count) malformed dataset rows.")
@force_option("Regenerate a rollout that is already published.")
@click.pass_context
def rollout_cmd(ctx: click.Context, run_dir: str | None, overrides: tuple[str, ...], dry_run: bool,
                rollout_id: int | None, next_: bool, engine_urls: tuple[str, ...], skip_bad_rows: bool | None,
                force: bool) -> None:
    """Generate one rollout on the registered engines (prompts x n samples, rewards, filters) and
    publish it as RUN/rollouts/N. Prints the artifact path. `rollout import FILE` publishes
    samples made elsewhere instead.

    \b
    Examples:
      slimectl rollout -r runs/a --next
      slimectl rollout -r runs/a --id 3 --force --set rollout.temperature=0.8
      slimectl rollout import trajectories.jsonl -r runs/a
    """
    from slimectl.commands._stage import open_stage
    from slimectl.errors import UsageError

    if ctx.invoked_subcommand is not None:
        if rollout_id is not None or next_ or engine_urls or force or overrides or dry_run:
            raise UsageError(f"options before `{ctx.invoked_subcommand}` belong to generation; put them after it")
        return

    if rollout_id is not None and next_:
        raise UsageError("pass either --id N or --next, not both")
    opened = open_stage(ctx, "rollout", run_dir, overrides, dry_run)
    if opened is None:
        return
    run, cfg = opened
    from slimectl.rollout.stage import run_rollout

    result = run_rollout(run, cfg, rollout_id, engine_urls, force=force, skip_bad_rows=skip_bad_rows)
    click.echo(str(result.path))


@rollout_cmd.command("import", short_help="Publish samples made outside slimectl as the next rollout.")
@click.argument("file", type=click.Path(dir_okay=False))
@stage_options
@click.option("--id", "rollout_id", type=click.IntRange(min=0), help="Rollout id to publish (default: the next one).")
@force_option("Replace a rollout that is already published.")
@click.pass_context
def import_cmd(ctx: click.Context, file: str, run_dir: str | None, overrides: tuple[str, ...], dry_run: bool,
               rollout_id: int | None, force: bool) -> None:
    """Validate FILE (JSON Lines of Sample objects, or a samples Parquet file) and publish it as
    RUN/rollouts/N, which `slimectl train` then consumes exactly once. Prints the artifact path.

    \b
    Each line: {"group_index": 0, "tokens": [...prompt + response ids...], "response_length": 5,
                "reward": 1.0, "rollout_log_probs": [...], "loss_mask": [...]}
    """
    from slimectl.commands._stage import open_stage

    opened = open_stage(ctx, "rollout", run_dir or ctx.parent.params.get("run_dir"), overrides, dry_run)
    if opened is None:
        return
    run, cfg = opened
    from slimectl.rollout.importer import import_rollout

    result = import_rollout(run, cfg, file, rollout_id, force)
    click.echo(str(result.path))
