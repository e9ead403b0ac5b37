"""Relaunching a command under torchrun: every rank starts from the run, not from the command's options.

A multi-rank ``convert``/``train``/``rl`` starts ``python -m torch.distributed.run ... -m slimectl _rank
STAGE [RUN] --call JSON`` (:func:`rank_argv`). A rank takes what it runs from the launching command's
own resolution, never from its command line: the stage's effective config as the launcher saved it
(``RUN/configs/STAGE.yaml``; :func:`rank_config` checks that it is still the config the launcher
resolved) and the keyword arguments of the stage's library call (``--call``: the ids, flags and paths
that are not config, as JSON). The hidden ``_rank`` command (``slimectl/commands/rank.py``) runs the
stage's own code with them. The ranks import the slimectl this process runs, never a ``slimectl/``
folder in the working directory (:func:`child_env`).

The launching process only builds a command line and waits: nothing here imports torch (a
relaunching ``train``/``rl`` would pay ~3 CPU-s for it, on top of torchrun's own import);
tests/unit/test_import_cost.py checks it.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

from slimectl.contract.errors import UsageError
from slimectl.contract.net import free_port

if TYPE_CHECKING:
    from slimectl.contract.config_schema import SlimectlConfig
    from slimectl.contract.rundir import RunDir

log = logging.getLogger("slimectl.torchrun")

RANK_COMMAND = "_rank"
"""The hidden ``slimectl`` command every relaunched rank runs (``slimectl/commands/rank.py``)."""


def log_verbosity() -> int:
    """The ``-v``/``-q`` count that gives the ranks this process's log level (``setup_logging``'s inverse)."""
    level = logging.getLogger("slimectl").getEffectiveLevel()
    if level <= logging.DEBUG:
        return 1
    return 0 if level <= logging.INFO else -1 if level <= logging.WARNING else -2


def rank_argv(stage: str, run_path: str | Path | None, call: Mapping[str, Any],
              fingerprint: str | None = None) -> list[str]:
    """The ``slimectl`` arguments of every rank of a relaunched ``STAGE``: ``[-v|-q...] _rank STAGE [RUN]
    --call JSON [--config-sha SHA]``. ``call`` holds the keyword arguments of the stage's call (plain JSON
    values); with ``fingerprint`` (the launcher's ``cfg.fingerprint()``) the ranks read the config the
    launcher saved as ``RUN/configs/STAGE.yaml`` and refuse any other."""
    v = log_verbosity()
    argv = ["-v"] * v if v > 0 else ["-q"] * -v
    argv += [RANK_COMMAND, stage, *([str(run_path)] if run_path is not None else [])]
    argv += ["--call", json.dumps(dict(call), sort_keys=True)]
    return argv + (["--config-sha", fingerprint] if fingerprint else [])


def rank_config(stage: str, run_path: str | Path, fingerprint: str) -> tuple[RunDir, SlimectlConfig]:
    """A relaunched rank's run and config: ``RUN/configs/STAGE.yaml`` as its launcher saved it, refused (one
    line) when it is not the config that launcher resolved (another ``slimectl STAGE`` saved its own since)."""
    from slimectl.contract.rundir import RunDir

    run = RunDir.open(run_path)
    cfg = run.saved_stage_config(stage)
    if cfg.fingerprint() != fingerprint:
        raise UsageError(f"{run.path / 'configs' / f'{stage}.yaml'} is not the config this rank's `slimectl {stage}` "
                         f"resolved (another `slimectl {stage}` on the run saved its own since); run it again")
    return run, cfg


def relaunch_stage(stage: str, nproc: int, run_path: str | Path | None, call: Mapping[str, Any],
                   fingerprint: str | None = None, nnodes: int = 1, node_rank: int = 0,
                   master_addr: str | None = None, master_port: int | None = None) -> int:
    """Run ``STAGE`` on ``nproc`` ranks of this node under torchrun (:func:`rank_argv`,
    :func:`relaunch_under_torchrun`); return torchrun's exit code."""
    return relaunch_under_torchrun(nproc, rank_argv(stage, run_path, call, fingerprint), nnodes, node_rank,
                                   master_addr, master_port)


def check_node_options(nnodes: int = 1, node_rank: int = 0, master_addr: str | None = None,
                       master_port: int | None = None) -> None:
    """Refuse node options a multi-node torchrun job cannot start with (one line naming the option)."""
    if nnodes > 1 and not (master_addr and master_port):
        raise UsageError(f"--nnodes {nnodes} needs --master-addr (node 0's address, reachable from every node) "
                         f"and --master-port (the same free port on every node)")
    if not 0 <= node_rank < nnodes:
        raise UsageError(f"--node-rank {node_rank} must be in 0..{nnodes - 1} (--nnodes {nnodes})")


def relaunch_under_torchrun(nproc: int, argv: list[str], nnodes: int = 1, node_rank: int = 0,
                            master_addr: str | None = None, master_port: int | None = None) -> int:
    """Run ``python -m slimectl ARGV`` under torchrun with ``nproc`` processes on this node; return
    its exit code. With ``nnodes`` > 1 every node runs this with its own ``node_rank`` and the same
    ``master_addr``/``master_port`` (node 0's address and a port open to the other nodes)."""
    check_node_options(nnodes, node_rank, master_addr, master_port)
    cmd = torchrun_command(nproc, argv, nnodes, node_rank, master_addr, master_port)
    log.info("launching %d processes%s: %s", nproc, f" on node {node_rank} of {nnodes}" if nnodes > 1 else "",
             " ".join(cmd[3:]))
    return subprocess.call(cmd, env=torchrun_env())


PYTHON_ENV = "SLIMECTL_PYTHON"
"""The command torchrun and its ranks are started with, split as a shell would (e.g. ``numactl
--interleave=all /venv/bin/python``; the test suite's fork client); unset: this interpreter."""


def python_command() -> list[str]:
    """``$SLIMECTL_PYTHON`` split into argv, else ``[sys.executable]``."""
    from slimectl.contract.child_python import python_from_env

    return python_from_env(PYTHON_ENV, sys.executable)


def torchrun_command(nproc: int, argv: list[str], nnodes: int = 1, node_rank: int = 0,
                     master_addr: str | None = None, master_port: int | None = None,
                     torchrun_args: list[str] | tuple[str, ...] = ()) -> list[str]:
    """``python -m torch.distributed.run ... [TORCHRUN_ARGS] -m slimectl ARGV`` (a free port when none is given).
    With ``$SLIMECTL_PYTHON`` set, torchrun runs under that command and starts each rank as that command
    followed by ``-u -m slimectl ARGV`` (torchrun's ``--no-python``)."""
    python = python_command()
    launcher = [*python, "-m", "torch.distributed.run", "--nnodes", str(nnodes), "--node_rank", str(node_rank),
                "--nproc_per_node", str(nproc), "--master_addr", master_addr or "127.0.0.1",
                "--master_port", str(master_port or free_port()), *torchrun_args]
    if python == [sys.executable]:
        return [*launcher, "-m", "slimectl", *argv]
    return [*launcher, "--no-python", *python, "-u", "-m", "slimectl", *argv]


def torchrun_env() -> dict[str, str]:
    """The ranks' environment: :func:`child_env`, one OpenMP thread per rank unless OMP_NUM_THREADS says otherwise."""
    env = child_env(os.environ)
    env["OMP_NUM_THREADS"] = os.environ.get("OMP_NUM_THREADS", "1")
    return env


def child_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The environment for ``python -m ...`` children that must import *this* slimectl.

    ``python -m`` puts the working directory first on ``sys.path``, so a ``slimectl/`` folder
    there (the parent of a clone, say) would be imported by the ranks instead of the package this
    process runs. ``PYTHONSAFEPATH=1`` (Python 3.11+) leaves the working directory off the
    children's path (and torchrun's own); when this process itself found slimectl through its
    working directory or script directory (a source checkout run in place), that directory is put
    on ``PYTHONPATH`` so the ranks import the very same code.
    """
    import slimectl

    env = dict(environ)
    env["PYTHONSAFEPATH"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(slimectl.__file__)))
    first = sys.path[0] if sys.path and not getattr(sys.flags, "safe_path", False) else None
    if first is not None and os.path.abspath(first or os.curdir) == root:
        entries = [e for e in env.get("PYTHONPATH", "").split(os.pathsep) if e]
        if root not in (os.path.abspath(e) for e in entries):
            env["PYTHONPATH"] = os.pathsep.join([root, *entries])
    return env
