"""``slimectl serve``: Start inference engines (embedded CPU engine or SGLang) and register them."""

from __future__ import annotations

import click

from slimectl.commands._options import stage_options
from slimectl.commands._stage import stage_config_or_unavailable


@click.command("serve", short_help="Start inference engines (embedded CPU engine or SGLang) and register them.")
@stage_options
@click.pass_context
def serve_cmd(ctx: click.Context, run_dir: str | None, overrides: tuple[str, ...], dry_run: bool) -> None:
    """Start inference engines (embedded CPU engine or SGLang) and register them.

    Reads the run's frozen config; --set may override this stage's own sections.
    """
    stage_config_or_unavailable(ctx, "serve", run_dir, overrides, dry_run, issue=4)
