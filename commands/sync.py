"""``slimectl sync``: push a published weight version to every registered engine."""

from __future__ import annotations

import click

from slimectl.commands._options import engine_urls_option, stage_options


@click.command("sync", short_help="Push a published weight version to every registered engine.")
@stage_options
@click.option("--version", "version", type=click.IntRange(min=0),
              help="Weight version to push (default: the latest in RUN/weights; 0 = the initial model).")
@click.option("--transport", type=click.Choice(["disk", "distributed"]), help="Override sync.transport.")
@click.option("--verify/--no-verify", default=None, help="Read the weights back from each engine and compare: every tensor by "
              "checksum (embedded engine), a sample by value.")
@engine_urls_option
@click.option("--follow", is_flag=True, help="Keep going: push each new weights/N as soon as it is published, "
              "until weights/{rollout.num_rollout} is in the engines.")
@click.pass_context
def sync_cmd(ctx: click.Context, run_dir: str | None, overrides: tuple[str, ...], dry_run: bool, version: int | None,
             transport: str | None, verify: bool | None, engine_urls: tuple[str, ...], follow: bool) -> None:
    """Pause each engine, load weight version N (disk: weights/N through /update_weights_from_disk;
    distributed: a gloo/NCCL broadcast in buckets), continue it, and check that every engine
    reports version N. Engines are never left paused. Prints the version and the engines.

    \b
    Examples:
      slimectl sync -r runs/a
      slimectl sync -r runs/a --version 3 --transport distributed --verify
      slimectl sync -r runs/a --follow     # with `rollout --follow` and `train --follow`: fully async
    """
    from slimectl.commands._stage import open_stage
    from slimectl.contract.errors import UsageError

    if follow and version is not None:
        raise UsageError("--follow pushes each new weights/N; it takes no --version")
    opened = open_stage(ctx, "sync", run_dir, overrides, dry_run)
    if opened is None:
        return
    run, cfg = opened
    if follow:
        from slimectl.contract.signals import StopOnSignal
        from slimectl.stages.sync.stage import follow_sync

        with StopOnSignal() as signals:
            follow_sync(run, cfg, transport, verify, engine_urls, stop=signals.stop,
                        on_synced=lambda res: click.echo(_pushed_line(res)))
        signals.raise_if_signalled()
        return
    from slimectl.stages.sync import run_sync

    result = run_sync(run, cfg, version, transport, verify, engine_urls)
    click.echo(_pushed_line(result))


def _pushed_line(result) -> str:
    return (f"weight version {result.version} -> {', '.join(result.engines)} ({result.transport}, "
            f"{result.seconds:.2f} s{', verified' if result.verified else ''})")
