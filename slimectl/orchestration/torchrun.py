"""Relaunching a command under torchrun: its argv rebuilt from the command's own parameters.

A multi-rank ``convert``/``train`` starts ``python -m torch.distributed.run ... -m slimectl CMD ARGV``
with the very options it was given. ARGV is not written by hand: :func:`argv_from_params` walks
the command's parameter objects (click's, duck-typed: this library never imports click) and emits
every non-default value in the option's own spelling, so an option added to the command later
is passed to every rank without anyone remembering to. The ranks import the slimectl this process
runs, never a ``slimectl/`` folder in the working directory (:func:`child_env`).

The launching process only builds a command line and waits: nothing here imports torch (a
relaunching ``train``/``rl`` would pay ~3 CPU-s for it, on top of torchrun's own import);
tests/unit/test_import_cost.py checks it.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from typing import Any, Iterable, Mapping

from slimectl.contract.errors import UsageError
from slimectl.contract.net import free_port

log = logging.getLogger("slimectl.torchrun")


def _spelling(param: Any) -> str:
    """The option's long name when it has one (``--max-rollouts``), else its first name (``-r``)."""
    longs = [o for o in param.opts if o.startswith("--")]
    return longs[0] if longs else param.opts[0]


def _text(value: Any) -> str:
    return repr(value) if isinstance(value, float) else str(value)


def argv_from_params(params: Iterable[Any], values: Mapping[str, Any]) -> list[str]:
    """The command-line arguments that parse back into ``values``.

    ``params`` are a command's parameter objects (click's ``ctx.command.params``: each with
    ``name``, ``opts``, ``secondary_opts``, ``default``, ``is_flag``, ``multiple``, ``count``,
    ``nargs``, ``param_type_name``); ``values`` are the parsed values (``ctx.params``, with any
    replaced). Options equal to their default are left out; flags are emitted bare (``--x``, or
    the ``--no-x`` side of a ``--x/--no-x`` pair), repeatable options once per value, counted
    options once per count; arguments follow the options, after ``--``.
    """
    argv: list[str] = []
    positional: list[str] = []
    for p in params:
        if p.name not in values:
            continue  # not exposed (--help)
        value = values[p.name]
        if p.param_type_name == "argument":
            items = value if (p.multiple or p.nargs != 1) and isinstance(value, (list, tuple)) else [value]
            positional += [_text(v) for v in items if v is not None]
            continue
        if p.param_type_name != "option":
            continue
        default = p.default() if callable(p.default) else p.default
        if value is None or value == default or (p.multiple and not value):
            continue
        opt = _spelling(p)
        if getattr(p, "count", False):
            argv += [opt] * int(value)
        elif p.is_flag:
            if value is False:
                if not p.secondary_opts:
                    continue  # a plain flag left off
                argv.append(p.secondary_opts[0])
            elif value is True or value == p.flag_value:
                argv.append(opt)
            else:
                raise ValueError(f"option {opt}: flag value {value!r} cannot be spelled on a command line")
        elif p.multiple:
            for v in value:
                argv += [opt, *(map(_text, v) if p.nargs != 1 else [_text(v)])]
        elif p.nargs != 1:
            argv += [opt, *map(_text, value)]
        else:
            argv += [opt, _text(value)]
    return argv + (["--", *positional] if positional else [])


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
