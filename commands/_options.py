"""Option sets shared by several commands (decorator factories, as sqlite-utils does)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import click

F = Callable[..., Any]


@dataclass
class AppState:
    """What the root group learned from the global options; stored in ``ctx.obj``."""

    run_dir: str | None = None
    verbosity: int = 0


def resolve_run_dir(ctx: click.Context, value: str | None) -> str | None:
    """A subcommand's ``-r`` wins over the root's ``-r`` / ``SLIMECTL_RUN_DIR``."""
    if value:
        return value
    state = ctx.find_object(AppState)
    return state.run_dir if state else None


def run_dir_option(fn: F) -> F:
    return click.option(
        "-r",
        "--run-dir",
        "run_dir",
        type=click.Path(file_okay=False),
        default=None,
        help="Run directory (default: the root -r, or env SLIMECTL_RUN_DIR).",
    )(fn)


def overrides_option(fn: F) -> F:
    return click.option(
        "--set",
        "overrides",
        multiple=True,
        metavar="KEY=VALUE",
        help="Override a config key of this stage's sections, e.g. --set train.lr=1e-5 (repeatable).",
    )(fn)


def dry_run_option(fn: F) -> F:
    return click.option(
        "--dry-run", is_flag=True, help="Print the resolved config as YAML and exit without doing anything."
    )(fn)


def force_option(help: str = "Replace existing output instead of refusing.") -> Callable[[F], F]:
    def deco(fn: F) -> F:
        return click.option("--force", is_flag=True, help=help)(fn)

    return deco


def engine_urls_option(fn: F) -> F:
    """``--engine-url URL`` (repeatable): use these engines instead of the registered ones."""
    return click.option("--engine-url", "engine_urls", multiple=True, metavar="URL",
                        help="Use these engines instead of the registered ones (repeatable).")(fn)


def stage_options(fn: F) -> F:
    """-r/--run-dir, --set and --dry-run: what every stage that reads the run config takes."""
    for deco in (dry_run_option, overrides_option, run_dir_option):
        fn = deco(fn)
    return fn
