"""``slimectl _rank STAGE [RUN] --call JSON [--config-sha SHA]`` (hidden): one rank of a relaunched command.

``train``, ``convert`` and ``rl`` with more than one rank relaunch themselves under torchrun with this
command on every rank (:func:`slimectl.orchestration.torchrun.rank_argv`). The rank runs the stage's own
code (:data:`RANK_STAGES`) with the run and config its launcher resolved: the config read back from
``RUN/configs/STAGE.yaml`` (with ``--config-sha``, which must match it) and the keyword arguments of the
stage's call (``--call``). Errors, Ctrl-C and logging are the root group's, as for any command.
"""

from __future__ import annotations

import importlib
import json

import click

#: STAGE -> "module:function", called as ``function(run, cfg, **call)`` (run and cfg None without RUN / --config-sha).
RANK_STAGES: dict[str, str] = {
    "train": "slimectl.commands.train:train_here",
    "convert": "slimectl.commands.convert:convert_here",
    "rl": "slimectl.commands.rl:rl_rank",
}


@click.command("_rank", hidden=True)
@click.argument("stage", type=click.Choice(list(RANK_STAGES)))
@click.argument("run_dir", required=False, type=click.Path(file_okay=False))
@click.option("--call", "call_json", default="{}", metavar="JSON", help="The stage call's keyword arguments.")
@click.option("--config-sha", "fingerprint", metavar="SHA", help="Run with RUN/configs/STAGE.yaml; its fingerprint.")
def rank_cmd(stage: str, run_dir: str | None, call_json: str, fingerprint: str | None) -> None:
    """One rank of `slimectl STAGE` relaunched under torchrun (started by the command itself)."""
    run = cfg = None
    if run_dir is not None and fingerprint is not None:
        from slimectl.orchestration.torchrun import rank_config

        from slimectl.contract.metrics import configure_wandb

        run, cfg = rank_config(stage, run_dir, fingerprint)
        configure_wandb(cfg, run.path)  # logging.wandb: as the launcher's open_stage set it
    elif run_dir is not None:
        from slimectl.contract.rundir import RunDir

        run = RunDir.open(run_dir)
    module, attr = RANK_STAGES[stage].split(":")
    getattr(importlib.import_module(module), attr)(run, cfg, **json.loads(call_json))
