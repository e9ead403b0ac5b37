"""What one ``slimectl rl`` process does: follow rank 0, relaunch itself under torchrun, or run the loop.

The ``rl`` command is a thin adapter over :func:`run_rl_process`, which also works from Python.
A process is in one of four roles:

- a trainer rank under torchrun (:func:`run_rl_rank`): rank 0 runs the loop with a trainer whose
  calls the other ranks follow; ranks > 0 follow them and return (no lock, no engine, nothing
  written). Relaunched by ``rl`` itself, a rank runs with the config the launcher saved
  (``RUN/configs/rl.yaml``: ``slimectl _rank rl RUN``); under a torchrun of the user's, each rank
  resolves it from its own options;
- ``dry_run``: the resolved config, nothing written;
- the launching ``rl`` of a trainer with ``train.tp*pp*dp > 1`` (local launcher): it checks that no
  other ``rl`` holds the run, relaunches itself under torchrun (the run, its saved config and
  ``engine_urls``) and reports torchrun's exit code or the signal rank 0 stopped on;
- otherwise (one process): the loop, with the first SIGINT/SIGTERM stopping every stage cleanly.
"""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass
from pathlib import Path

from slimectl.contract.signals import InterruptOnSignal, StageInterrupted


@dataclass
class RlProcessOutcome:
    """How one ``rl`` process ended (a signal is raised as :class:`StageInterrupted` instead)."""

    result: object | None = None
    """The loop's :class:`~slimectl.orchestration.loop.RLResult` (one process or rank 0), else None."""
    dry_run_yaml: str | None = None
    """With ``dry_run``: the resolved config as YAML."""
    exit_code: int = 0
    """The relaunched torchrun job's exit code (the launching process), else 0."""


def run_rl_process(run_path: str | Path | None, config_path: str | Path | None = None,
                   overrides: list[str] | tuple[str, ...] = (), *, tiny_model: str | None = None,
                   pretrained: str | None = None, dry_run: bool = False,
                   engine_urls: list[str] | tuple[str, ...] = (), launcher: str = "local",
                   address: str | None = None, colocate: bool | None = None) -> RlProcessOutcome:
    """Run this process's part of ``slimectl rl`` (see the module docstring). Raises
    :class:`StageInterrupted` when a signal stopped the run."""
    from slimectl.contract.ranks import launch_rank, under_torchrun
    from slimectl.orchestration.loop import make_launcher
    from slimectl.orchestration.preflight import prepare_rl

    placer = make_launcher(launcher, address, colocate)
    torchrun_rank = launcher == "local" and under_torchrun()
    if torchrun_rank and launch_rank() > 0:  # a torchrun of the user's: rank 0's config, read without writing
        from slimectl.orchestration.torchrun_trainer import follower_config

        return run_rl_rank(*follower_config(run_path, overrides), engine_urls)
    run, cfg = prepare_rl(config_path, run_path, overrides, tiny_model, dry_run, pretrained)
    if run is None:
        return RlProcessOutcome(dry_run_yaml=cfg.to_yaml())
    if launcher != "ray":  # the critic runs on the trainer's ranks: refused here once, not on every rank
        from slimectl.contract.config_checks import critic_layout_problem
        from slimectl.contract.errors import ConfigError

        problem = critic_layout_problem(cfg)
        if problem:
            raise ConfigError(problem)
    if torchrun_rank:
        return run_rl_rank(run, cfg, engine_urls)
    if launcher == "local" and cfg.train.world_size > 1:
        # the trainer's ranks under torchrun: rank 0 runs this command's loop, the others follow
        from slimectl.orchestration.torchrun import rank_argv
        from slimectl.orchestration.torchrun_trainer import relaunch_rl

        with run.lock("rl"):
            pass  # fail here, in a second, when another rl runs, not on every rank
        # every rank: the config prepare_rl saved as RUN/configs/rl.yaml, and the engines given
        res = relaunch_rl(cfg.train.world_size,
                          rank_argv("rl", run.path, {"engine_urls": list(engine_urls)}, cfg.fingerprint()))
        if res.signal is not None:
            raise StageInterrupted(res.signal)
        return RlProcessOutcome(exit_code=res.code)
    return _loop(run, cfg, engine_urls, placer)


def run_rl_rank(run, cfg, engine_urls: list[str] | tuple[str, ...] = ()) -> RlProcessOutcome:
    """One rank of a trainer under torchrun: ranks > 0 follow rank 0's trainer calls; rank 0 runs the loop."""
    from slimectl.contract.ranks import launch_rank
    from slimectl.orchestration import torchrun_trainer as tt

    if launch_rank() > 0:  # rank 0 runs the loop, this one follows its trainer calls
        tt.follow_as_rank(run, cfg)
        return RlProcessOutcome()
    tt.write_status(pid=os.getpid())
    tt.check_world(cfg)
    return _loop(run, cfg, engine_urls, None, torchrun=True)


def _loop(run, cfg, engine_urls, placer, torchrun: bool = False) -> RlProcessOutcome:
    """The loop in this process (one process, or rank 0 of torchrun's), the first SIGINT/SIGTERM stopping it."""
    from slimectl.orchestration.loop import run_rl

    # The first SIGINT/SIGTERM stops every stage cleanly; the CLI prints the command that resumes
    # the run and exits 128 + the signal.
    signals = InterruptOnSignal(threading.Event()).install()
    if torchrun:
        from slimectl.orchestration import torchrun_trainer as tt

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
        if torchrun and tt.reports_to_launcher():
            tt.write_status(signal=signals.signal or signal.SIGINT)  # the launching rl reports it and exits 128+N
            return RlProcessOutcome()
        raise StageInterrupted(signals.signal)
    return RlProcessOutcome(result=res)
