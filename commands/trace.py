"""``slimectl trace``: the run's traces merged into one Chrome trace, with who waited how long."""

from __future__ import annotations

import click

from slimectl.commands._options import resolve_run_dir, run_dir_option


@click.command("trace", short_help="Merge the stages' traces into one Chrome trace; show who waited.")
@run_dir_option
@click.option("-o", "--out", type=click.Path(dir_okay=False),
              help="Chrome trace JSON to write (default: RUN/traces/trace.json).")
@click.pass_context
def trace_cmd(ctx: click.Context, run_dir: str | None, out: str | None) -> None:
    """Merge every RUN/traces/STAGE.jsonl (the spans rollout, train, sync and rl write as they run) into
    one Chrome trace (the Trace Event Format: open it in chrome://tracing or https://ui.perfetto.dev),
    one process per stage process. Prints per process its spans, the seconds it worked and the seconds
    it spent in each kind of wait (wait:rollout, wait:weights, ...), then the file written.

    \b
    Example:
      slimectl trace -r runs/a --out trace.json
    """
    from slimectl.contract.rundir import RunDir
    from slimectl.stages.trace import summary_table, write_trace

    run = RunDir.open(resolve_run_dir(ctx, run_dir))
    path, merged = write_trace(run, out)
    click.echo(summary_table(merged.processes))
    spans = sum(len(p.spans) for p in merged.processes)
    click.echo(f"wrote {path}: {spans} spans of {len(merged.processes)} process(es) from {merged.files} trace "
               f"file(s); open it in chrome://tracing or https://ui.perfetto.dev")
