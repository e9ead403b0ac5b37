"""``slimectl rollout``: generate and score one rollout into the run directory."""

from __future__ import annotations

import click

from slimectl.commands._options import engine_urls_option, force_option, resolve_run_dir, run_dir_option, stage_options

BUFFER_TOKEN_ENV = "SLIMECTL_BUFFER_TOKEN"


class RolloutGroup(click.Group):
    """Reads ``--source buffer URL`` (the buffer's URL right after the source) as
    ``--source buffer --buffer-url URL``: click options take a fixed number of values."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        args = list(args)
        for i, a in enumerate(args[:-1]):
            if a in ("--source", "--source=buffer") and (a != "--source" or args[i + 1] == "buffer"):
                at = i + (2 if a == "--source" else 1)
                if at < len(args) and not args[at].startswith("-") and args[at] not in self.commands:
                    args[at:at + 1] = ["--buffer-url", args[at]]
                break
        return super().parse_args(ctx, args)


@click.group("rollout", cls=RolloutGroup, invoke_without_command=True,
             short_help="Generate and score one rollout into the run directory.")
@stage_options
@click.option("--id", "rollout_id", type=click.IntRange(min=0), help="Rollout id to produce.")
@click.option("--next", "next_", is_flag=True, help="Produce the next rollout id (the default).")
@engine_urls_option
@click.option("--skip-bad-rows", is_flag=True, default=None, help="Skip (and count) malformed dataset rows.")
@force_option("Regenerate a rollout that is already published.")
@click.option("--source", type=click.Choice(["engines", "buffer"]), default="engines", show_default=True,
              help="engines: generate on the engines. `buffer URL`: collect rollout.batch_size complete groups "
                   "from a rollout buffer service instead.")
@click.option("--buffer-url", hidden=True, help="The buffer's URL (what `--source buffer URL` sets).")
@click.option("--buffer-token", envvar=BUFFER_TOKEN_ENV, show_envvar=True,
              help="With --source buffer: the buffer's token (prefer the env var: a flag shows in ps).")
@click.option("--wait-timeout", type=click.FloatRange(min=0), help="With --source buffer: give up after this many "
              "seconds without enough complete groups (default: wait).")
@click.option("--follow", is_flag=True, help="Keep generating: publish each rollout as soon as its batch is scored, "
              "at most rollout.max_staleness versions ahead of the newest weights/N, until rollout.num_rollout.")
@click.pass_context
def rollout_cmd(ctx: click.Context, run_dir: str | None, overrides: tuple[str, ...], dry_run: bool,
                rollout_id: int | None, next_: bool, engine_urls: tuple[str, ...], skip_bad_rows: bool | None,
                force: bool, source: str, buffer_url: str | None, buffer_token: str | None,
                wait_timeout: float | None, follow: bool) -> None:
    """Generate one rollout on the registered engines (prompts x n samples, rewards, filters) and
    publish it as RUN/rollouts/N. Prints the artifact path. `rollout import FILE` publishes
    samples made elsewhere instead; `--source buffer URL` collects them from a rollout buffer
    service (`rollout buffer serve`), each group exactly once.

    \b
    Examples:
      slimectl rollout -r runs/a --next
      slimectl rollout -r runs/a --id 3 --force --set rollout.temperature=0.8
      slimectl rollout import trajectories.jsonl -r runs/a
      slimectl rollout -r runs/a --source buffer http://127.0.0.1:8889
      slimectl rollout -r runs/a --follow        # with `train --follow` and `sync --follow`: fully async
    """
    from slimectl.commands._stage import open_stage
    from slimectl.contract.errors import UsageError

    explicit = {name for name in ("source", "buffer_url", "wait_timeout")
                if ctx.get_parameter_source(name) == click.core.ParameterSource.COMMANDLINE}
    if ctx.invoked_subcommand is not None:
        if rollout_id is not None or next_ or engine_urls or force or overrides or dry_run or explicit or follow:
            raise UsageError(f"options before `{ctx.invoked_subcommand}` belong to generation; put them after it")
        return

    if rollout_id is not None and next_:
        raise UsageError("pass either --id N or --next, not both")
    if follow and (rollout_id is not None or force or source == "buffer"):
        raise UsageError("--follow publishes the next rollouts in order; it takes neither --id, --force nor --source buffer")
    if source == "buffer":
        if not buffer_url:
            raise UsageError("--source buffer needs the buffer's URL: --source buffer http://HOST:PORT")
        if engine_urls or skip_bad_rows is not None:
            raise UsageError("--engine-url and --skip-bad-rows are for generation; --source buffer uses neither")
    elif explicit - {"source"}:
        raise UsageError("a buffer URL and --wait-timeout go with --source buffer URL")
    opened = open_stage(ctx, "rollout", run_dir, overrides, dry_run)
    if opened is None:
        return
    run, cfg = opened
    if source == "buffer":
        from slimectl.stages.rollout.buffer_source import collect_rollout

        result = collect_rollout(run, cfg, buffer_url, buffer_token or None, rollout_id, force, wait_timeout)
        click.echo(str(result.path))
        return
    if follow:
        from slimectl.contract.signals import StopOnSignal
        from slimectl.stages.rollout.follow import follow_rollouts

        with StopOnSignal() as signals:
            follow_rollouts(run, cfg, engine_urls, stop=signals.stop, skip_bad_rows=skip_bad_rows,
                            on_published=lambda rid: click.echo(str(run.rollouts.dir_for(rid))))
        signals.raise_if_signalled()
        return
    from slimectl.stages.rollout.stage import run_rollout

    result = run_rollout(run, cfg, rollout_id, engine_urls, force=force, skip_bad_rows=skip_bad_rows)
    if not result.complete:  # complete: the run's last rollout exists; the stage said so on stderr
        click.echo(str(result.path))


@rollout_cmd.command("import", short_help="Publish samples made outside slimectl as the next rollout.")
@click.argument("file", type=click.Path(dir_okay=False))
@stage_options
@click.option("--id", "rollout_id", type=click.IntRange(min=0), help="Rollout id to publish (default: the next one).")
@force_option("Replace a rollout that is already published.")
@click.pass_context
def import_cmd(ctx: click.Context, file: str, run_dir: str | None, overrides: tuple[str, ...], dry_run: bool,
               rollout_id: int | None, force: bool) -> None:
    """Validate FILE (JSON Lines of Sample objects, or a samples Parquet file) and publish it as
    RUN/rollouts/N, which `slimectl train` then consumes exactly once. Prints the artifact path.

    \b
    Each line: {"group_index": 0, "tokens": [...prompt + response ids...], "response_length": 5,
                "reward": 1.0, "rollout_log_probs": [...], "loss_mask": [...]}
    """
    from slimectl.commands._stage import open_stage

    opened = open_stage(ctx, "rollout", run_dir or ctx.parent.params.get("run_dir"), overrides, dry_run)
    if opened is None:
        return
    run, cfg = opened
    from slimectl.stages.rollout.importer import import_rollout

    result = import_rollout(run, cfg, file, rollout_id, force)
    click.echo(str(result.path))


@rollout_cmd.group("buffer", short_help="The rollout buffer service that external producers write trajectories to.")
def buffer_group() -> None:
    """A rollout buffer is an HTTP service where agent frameworks and other producers start tasks
    and write trajectories (Sample JSON); `slimectl rollout --source buffer URL` collects complete
    groups from it, each exactly once. Protocol: docs/rollout-buffer.md.
    """


@buffer_group.command("serve", short_help="Serve a rollout buffer persisted in a directory.")
@click.option("--dir", "directory", required=True, type=click.Path(file_okay=False),
              help="Directory the buffer keeps its journal in (created if missing; a restart resumes it).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (default: loopback only).")
@click.option("--port", type=click.IntRange(0, 65535), default=8889, show_default=True,
              help="Port (0: pick a free one).")
@click.option("--token", envvar=BUFFER_TOKEN_ENV, show_envvar=True,
              help="Require Authorization: Bearer TOKEN on every endpoint but /health and /stats "
                   "(prefer the env var: a flag shows in ps).")
@click.option("--n-samples-per-prompt", type=click.IntRange(min=1),
              help="Samples that complete a group (default: the run's rollout.n_samples_per_prompt).")
@click.option("--lease-timeout", type=click.FloatRange(min=0, min_open=True), default=600.0, show_default=True,
              help="Seconds a taken batch stays leased without an ack before its groups are handed out again.")
@click.option("--max-body-mb", type=click.FloatRange(min=0, min_open=True), default=64.0, show_default=True,
              help="Refuse larger request bodies (HTTP 413).")
@click.option("--vocab-size", type=click.IntRange(min=1),
              help="Refuse token ids >= this (default: the run model's vocabulary).")
@click.option("--reward-key", help="Key of dict rewards (default: the run's rollout.reward_key).")
@run_dir_option
@click.pass_context
def buffer_serve_cmd(ctx: click.Context, directory: str, host: str, port: int, token: str | None,
                     n_samples_per_prompt: int | None, lease_timeout: float, max_body_mb: float,
                     vocab_size: int | None, reward_key: str | None, run_dir: str | None) -> None:
    """Serve the rollout buffer kept in DIR until Ctrl-C/SIGTERM; prints its URL on stdout once
    it listens. With a run directory (-r, or the root's), the checks and the group size default
    to the run's config, so trajectories the run cannot train on are refused when written.

    \b
    Examples:
      slimectl rollout buffer serve --dir runs/a/buffer -r runs/a
      SLIMECTL_BUFFER_TOKEN=s3cret slimectl rollout buffer serve --dir buf --n-samples-per-prompt 8 --port 0
    """
    from slimectl.contract.errors import UsageError
    from slimectl.services.rollout_buffer import serve_buffer

    path = resolve_run_dir(ctx, run_dir or ctx.parent.parent.params.get("run_dir"))
    images = None
    if path is not None:
        from slimectl.stages.rollout.importer import image_check, model_vocab_size
        from slimectl.contract.rundir import RunDir

        run = RunDir.open(path)
        cfg = run.config()
        n_samples_per_prompt = n_samples_per_prompt or cfg.rollout.n_samples_per_prompt
        reward_key = reward_key or cfg.rollout.reward_key
        vocab_size = vocab_size or model_vocab_size(cfg, allow_vlm=True)
        images = image_check(run, cfg)
    if n_samples_per_prompt is None:
        raise UsageError("pass --n-samples-per-prompt N, or -r RUN to take it from the run's config")
    serve_buffer(directory, n_samples_per_prompt, host, port, token, lease_timeout, max_body_mb, vocab_size, reward_key,
                 announce=click.echo, images=images)
