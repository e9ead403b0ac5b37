"""The ``slimectl`` root group: global options, lazy subcommands from one table, error policy."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any

import click

from slimectl import __version__
from slimectl.commands._options import AppState

#: The command table: name -> "module:attribute". Modules load only when their command runs
#: (or its help is shown), so the root help never imports torch.
COMMANDS: dict[str, str] = {
    "init": "slimectl.commands.init:init_cmd",
    "status": "slimectl.commands.status:status_cmd",
    "convert": "slimectl.commands.convert:convert_cmd",
    "serve": "slimectl.commands.serve:serve_cmd",
    "rollout": "slimectl.commands.rollout:rollout_cmd",
    "train": "slimectl.commands.train:train_cmd",
    "sync": "slimectl.commands.sync:sync_cmd",
    "export": "slimectl.commands.export:export_cmd",
    "rl": "slimectl.commands.rl:rl_cmd",
    "extend": "slimectl.commands.extend:extend_cmd",
    "inspect": "slimectl.commands.inspect:inspect_cmd",
    "plot": "slimectl.commands.plot:plot_cmd",
    "trace": "slimectl.commands.trace:trace_cmd",
    "harness": "slimectl.commands.harness:harness_cmd",
}

#: Commands left out of the help and the completions: what the ranks of a relaunched command run.
HIDDEN_COMMANDS: dict[str, str] = {"_rank": "slimectl.commands.rank:rank_cmd"}

DEBUG_ENV = "SLIMECTL_DEBUG"


class CliError(click.ClickException):
    """A one-line error with the exit code of the library error it came from."""

    def __init__(self, message: str, exit_code: int = 1):
        super().__init__(message)
        self.exit_code = exit_code


class Interrupted(click.ClickException):
    """Ctrl-C/SIGTERM stopped the command: one line with the command that resumes it (no "Error:")."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code

    def show(self, file: Any = None) -> None:
        if self.message:
            click.echo(self.message, err=True, file=file)


def invoked_argv(ctx: click.Context) -> list[str]:
    """The command line of this invocation after the program name: the root options given on the
    command line (-r, -v, -q), then the subcommand and its arguments exactly as typed."""
    out: list[str] = []
    src = click.core.ParameterSource.COMMANDLINE
    if ctx.params.get("run_dir") and ctx.get_parameter_source("run_dir") == src:
        out += ["-r", str(ctx.params["run_dir"])]
    for name, flag in (("verbose", "-v"), ("quiet", "-q")):
        out += [flag] * int(ctx.params.get(name) or 0)
    protected = getattr(ctx, "_protected_args", None)
    if protected is None:  # click < 8.2
        protected = ctx.protected_args
    return out + [*protected, *ctx.args]


def debug_enabled() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0", "false", "no")


class LazyGroup(click.Group):
    """A group whose subcommands are imported on first use, in table order."""

    def __init__(self, *args: Any, lazy_commands: dict[str, str] | None = None,
                 hidden_commands: dict[str, str] | None = None, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.lazy_commands = dict(lazy_commands or {})
        self.hidden_commands = dict(hidden_commands or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return list(self.lazy_commands) + [c for c in super().list_commands(ctx) if c not in self.lazy_commands]

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        target = self.lazy_commands.get(cmd_name) or self.hidden_commands.get(cmd_name)
        if target:
            module_name, attr = target.split(":")
            cmd = getattr(importlib.import_module(module_name), attr)
            if not isinstance(cmd, click.Command):
                raise TypeError(f"{target} is not a click command")
            return cmd
        return super().get_command(ctx, cmd_name)

    def invoke(self, ctx: click.Context) -> Any:
        from slimectl.contract.errors import SlimectlError

        argv = invoked_argv(ctx)  # before click consumes the subcommand's arguments
        from slimectl.contract.ranks import under_torchrun  # light: os only

        # Judged before the command runs: a one-rank in-process trainer sets WORLD_SIZE/LOCAL_RANK itself.
        torchrun_rank = under_torchrun()
        try:
            return super().invoke(ctx)
        except SlimectlError as exc:
            if debug_enabled():
                raise
            raise CliError(str(exc), exc.exit_code) from None
        except KeyboardInterrupt as exc:
            from slimectl.contract.signals import interrupted_exit_code, resume_hint

            if debug_enabled():
                raise
            # Under torchrun the launching command (ours, or the user's torchrun) is what resumes.
            raise Interrupted("" if torchrun_rank else resume_hint(argv), interrupted_exit_code(exc)) from None
        except (click.exceptions.ClickException, click.exceptions.Exit, click.exceptions.Abort):
            raise
        except Exception as exc:  # an unexpected failure: one line, traceback only on request
            if debug_enabled():
                raise
            raise CliError(f"unexpected {type(exc).__name__}: {exc} (rerun with {DEBUG_ENV}=1 for a traceback)", 1) from None


@click.group(
    cls=LazyGroup,
    lazy_commands=COMMANDS,
    hidden_commands=HIDDEN_COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option(
    "-r",
    "--run-dir",
    envvar="SLIMECTL_RUN_DIR",
    show_envvar=True,
    type=click.Path(file_okay=False),
    help="Run directory shared by all stages.",
)
@click.option("-v", "--verbose", count=True, help="More log output on stderr (-vv for debug).")
@click.option("-q", "--quiet", count=True, help="Less log output on stderr.")
@click.version_option(__version__, prog_name="slimectl")
@click.pass_context
def cli(ctx: click.Context, run_dir: str | None, verbose: int, quiet: int) -> None:
    """RL post-training of LLMs in stages that share one run directory.

    \b
    Stages run together (slimectl rl --config cfg.yaml) or one at a time:
      slimectl init RUN --config cfg.yaml     freeze a config into a run directory
      slimectl serve -r RUN                    start inference engines
      slimectl rollout -r RUN --next           generate + score one rollout
      slimectl train -r RUN --follow           train on each rollout exactly once
      slimectl sync -r RUN                     push new weights to the engines
      slimectl status -r RUN                   see where the run stands
      slimectl extend -r RUN --num-rollout N   make the run longer (any stage)

    Exit codes: 2 for usage, config and input errors, 1 for runtime errors, 130 after Ctrl-C
    (which prints the command that resumes the stage). Set SLIMECTL_DEBUG=1 for tracebacks on errors.
    """
    from slimectl.contract.logs import setup_logging

    ctx.obj = AppState(run_dir=run_dir, verbosity=verbose - quiet)
    setup_logging(verbose - quiet)


def main(argv: list[str] | None = None) -> None:
    cli.main(args=argv, prog_name="slimectl")


if __name__ == "__main__":  # pragma: no cover
    main(sys.argv[1:])
