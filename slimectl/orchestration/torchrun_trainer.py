"""``slimectl rl`` with a trainer of several ranks under torchrun (the local launcher, no Ray).

With ``train.tp*pp*dp = N > 1`` the local ``rl`` relaunches itself under torchrun with N ranks on
this node (:func:`relaunch_rl`); every rank runs ``slimectl _rank rl RUN`` with the config the launching ``rl``
saved as ``RUN/configs/rl.yaml`` and the engines it was given (:func:`slimectl.orchestration.torchrun.rank_argv`):

- rank 0 runs the whole loop exactly as a one-rank ``rl`` does (locks, engines, rollouts, eval,
  syncs, metrics), with :class:`TorchrunLauncher`: its trainer is
  :class:`~slimectl.orchestration.local_launcher.InProcessTrainer`, which announces each collective
  operation to the other ranks (:mod:`slimectl.orchestration.trainer_ranks`: train, checkpoint, publish
  weights, a pass over the tensors, and ``stop`` when the loop ends, however it ends);
- ranks > 0 run :func:`follow_as_rank`: a :class:`~slimectl.stages.train.trainer.Trainer` of their own that
  makes each announced operation with rank 0, until ``stop``. They hold no lock, write nothing, talk to no
  engine, and ignore SIGINT/SIGTERM once they follow: rank 0's graceful stop still needs them in its
  collectives.

Signals: the launching ``rl`` (the parent of torchrun, which runs in a session of its own) forwards
the first SIGINT/SIGTERM to rank 0 only. Rank 0 stops as a one-rank ``rl`` does -- a trainer call
in progress (a collective) is finished first, then what was trained since the last checkpoint is
checkpointed (with every rank), then ``stop`` -- reports the signal to the parent through a small
status file (``SLIMECTL_RL_STATUS``) and exits 0, so torchrun ends quietly; the parent then exits
128 + the signal and prints the command that resumes the run. If rank 0 dies (``kill -9``), the
other ranks' gloo calls fail at once and torchrun ends the job; if the parent dies, torchrun gets
SIGTERM (parent-death signal) and stops the ranks.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slimectl.contract.config_schema import SlimectlConfig
from slimectl.contract.errors import UsageError
from slimectl.contract.ranks import launch_rank
from slimectl.contract.rundir import RunDir
from slimectl.orchestration.local_launcher import InProcessTrainer, LocalLauncher
from slimectl.orchestration.trainer_ranks import Followers, control_group, follow_rank0

log = logging.getLogger("slimectl.rl")

STATUS_ENV = "SLIMECTL_RL_STATUS"
"""Set by :func:`relaunch_rl` for its ranks: the file where rank 0 writes its pid and how it stopped."""
SHUTDOWN_TIMEOUT_S = 600
"""How long torchrun waits for the ranks to stop after it got a signal (or a rank failed) before it kills them."""


def check_world(cfg: SlimectlConfig) -> None:
    """Under torchrun: refuse a job whose size is not the trainer's (one line)."""
    have = int(os.environ.get("WORLD_SIZE", "1"))
    if have != cfg.train.world_size:
        raise UsageError(f"train.tp*pp*dp = {cfg.train.world_size} processes are needed, this torchrun job has {have}; "
                         f"run `slimectl rl` itself (it launches torchrun with the right number of ranks)")


# ------------------------------------------------------------------------------ the relaunch
@dataclass
class RelaunchResult:
    code: int
    """torchrun's exit code."""
    signal: int | None
    """The signal rank 0 stopped on (reported by it, or received by this process), else None."""


def _read_status(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def write_status(**fields: Any) -> None:
    """Rank 0 of a relaunched ``rl``: record ``fields`` (its pid, the signal it stopped on) for the parent."""
    path = os.environ.get(STATUS_ENV)
    if not path or launch_rank() != 0:
        return
    data = {**_read_status(Path(path)), **fields}
    tmp = Path(f"{path}.tmp")
    tmp.write_text(json.dumps(data))
    tmp.replace(path)


def reports_to_launcher() -> bool:
    """Whether this rank 0 was started by :func:`relaunch_rl` (which reports an interruption itself)."""
    return bool(os.environ.get(STATUS_ENV)) and launch_rank() == 0


def _die_with_parent() -> None:
    """In the torchrun child before exec: SIGTERM when the launching ``rl`` dies (Linux), so no rank outlives it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def relaunch_rl(nproc: int, argv: list[str]) -> RelaunchResult:
    """Run ``python -m slimectl ARGV`` (a rank's, :func:`~slimectl.orchestration.torchrun.rank_argv`) under torchrun with ``nproc`` ranks on this node and wait.

    torchrun runs in a session of its own, so a Ctrl-C in the terminal reaches this process only:
    the first SIGINT/SIGTERM is forwarded to rank 0 (to torchrun while rank 0 has not started), later
    ones are ignored so the graceful stop runs whole. Returns torchrun's exit code and the signal
    the run stopped on."""
    import tempfile

    from slimectl.contract.signals import SignalHandlers
    from slimectl.orchestration.torchrun import torchrun_command, torchrun_env

    cmd = torchrun_command(nproc, argv, torchrun_args=["--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S)])
    log.info("launching %d processes: %s", nproc, " ".join(cmd[3:]))
    with tempfile.TemporaryDirectory(prefix="slimectl-rl-") as tmp:
        status = Path(tmp) / "rank0.json"
        env = {**torchrun_env(), STATUS_ENV: str(status)}
        got: list[int] = []
        proc: subprocess.Popen | None = None

        def forward(signum: int, frame: Any) -> None:
            if got or proc is None:
                return
            got.append(signum)
            pid = _read_status(status).get("pid")
            try:
                os.kill(int(pid) if pid else proc.pid, signum)
            except (ProcessLookupError, ValueError):
                pass

        with SignalHandlers(forward):
            proc = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=_die_with_parent)
            try:
                code = proc.wait()
            finally:
                if proc.poll() is None:  # this process is going down: take the job with it
                    proc.terminate()
                    proc.wait()
        reported = _read_status(status).get("signal")
    return RelaunchResult(code, int(reported) if reported else (got[0] if got else None))


# ------------------------------------------------------------------------------ the ranks
class TorchrunLauncher(LocalLauncher):
    """Rank 0's launcher: engines as with :class:`LocalLauncher`, the trainer an :class:`InProcessTrainer`
    whose collective operations ranks > 0 follow (:func:`follow_as_rank`)."""

    def __init__(self, critical=nullcontext):
        self.critical = critical

    def start_trainer(self, run: RunDir, cfg: SlimectlConfig, stack: ExitStack) -> InProcessTrainer:
        with self.critical():  # building the actor is collective too
            followers = Followers(None, self.critical)
            trainer = InProcessTrainer(run, cfg, stack, followers=followers)
            followers.group = control_group()
            stack.callback(trainer.stop)
        return trainer


def follower_config(run_path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> tuple[RunDir, SlimectlConfig]:
    """The run and config of a rank > 0: rank 0's view (the run's ``rl`` config with the same
    overrides), read without writing anything."""
    if run_path is None:
        raise UsageError("a rank of `slimectl rl` under torchrun needs -r RUN")
    run = RunDir.open(run_path)
    return run, run.stage_config("rl", list(overrides))


def follow_as_rank(run: RunDir, cfg: SlimectlConfig) -> int:
    """Rank > 0: build the trainer rank, then make every operation rank 0 announces until ``stop``; returns
    the number of operations made."""
    from slimectl.stages.train.trainer import FollowerLock, Trainer

    check_world(cfg)
    logging.getLogger("slimectl").setLevel(logging.WARNING)
    trainer = Trainer(run, cfg, FollowerLock())
    group = control_group()
    # From here rank 0 leads: its graceful stop needs this rank in its collectives.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        return follow_rank0(run, trainer, group, disk=cfg.sync.transport == "disk")
    finally:
        trainer.close()
