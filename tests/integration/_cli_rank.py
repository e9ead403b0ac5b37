"""A tests.helpers.RankWorker job: ``slimectl ARGV`` on every rank of the worker, as each rank of a
command that relaunched itself under torchrun runs it (``torchrun ... -m slimectl ARGV``).

    (a RankWorker job) _cli_rank.py ARGV...

The worker's ranks are torchrun ranks (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR set, the gloo
group kept from job to job), so ``slimectl train`` with train.tp*pp*dp = 2 runs its stage here
exactly as its two relaunched ranks do, without paying a torchrun launch (two interpreters
importing torch and megatron-core) per run. What the relaunch itself does (``launching 2
processes``, the ranks' argv) is tested where a real relaunch runs (test_moe_train.py's
``slimectl train`` at train.ep=2, test_rl_torchrun.py).

Prints ``CLI {"rank", "code", "stdout", "stderr"}`` (click's captured streams; a traceback in
stderr when the command raised). The tests call it through :func:`slimectl_on_ranks`.
"""

import json
import logging
import os
import signal
import sys
import traceback


def slimectl_on_ranks(ranks, *args) -> list[dict]:
    """``slimectl ARGS`` on every rank of RANKS (a tests.helpers.RankWorker): each rank's
    {"rank", "code", "stdout", "stderr"}, in rank order."""
    from pathlib import Path

    proc = ranks.run(Path(__file__), *map(str, args), timeout=600)
    outs = [json.loads(line[len("CLI "):]) for line in proc.stdout.splitlines() if line.startswith("CLI ")]
    assert sorted(o["rank"] for o in outs) == list(range(ranks.nproc)), proc.stdout[-3000:]
    return sorted(outs, key=lambda o: o["rank"])


def main() -> None:
    from click.testing import CliRunner

    from slimectl.commands.cli import cli

    log = logging.getLogger("slimectl")
    saved_signals = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

    def drop_console_handler():  # setup_logging binds one to the stderr click captures
        for h in [h for h in log.handlers if getattr(h, "_slimectl_console", False)]:
            log.removeHandler(h)

    drop_console_handler()
    try:
        res = CliRunner().invoke(cli, sys.argv[1:], prog_name="slimectl", catch_exceptions=True)
    finally:
        drop_console_handler()
        for s, h in saved_signals.items():
            signal.signal(s, h)
    err = res.stderr
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        err += "".join(traceback.format_exception(res.exception))
    print("CLI " + json.dumps({"rank": int(os.environ["RANK"]), "code": res.exit_code, "stdout": res.stdout,
                               "stderr": err}))


if __name__ == "__main__":
    main()
