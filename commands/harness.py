"""``slimectl harness``: an OpenAI-compatible chat endpoint that records agent trajectories."""

from __future__ import annotations

import click

from slimectl.commands._options import engine_urls_option, force_option, resolve_run_dir, run_dir_option


@click.command("harness", short_help="Serve an OpenAI-compatible chat API that records agent trajectories.")
@run_dir_option
@engine_urls_option
@click.option("--model", "model_path", type=click.Path(file_okay=False),
              help="HF model dir whose tokenizer and chat template the engines use (default: the run's model).")
@click.option("--out", "out_path", required=True, type=click.Path(dir_okay=False),
              help="JSON Lines file that receives every finished session (what `rollout import` reads).")
@click.option("--host", default="127.0.0.1", show_default=True, help="Interface to bind (loopback only by default).")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port (0: pick a free one).")
@click.option("--api-key", envvar="SLIMECTL_HARNESS_API_KEY", show_envvar=True,
              help="Require Authorization: Bearer KEY (prefer the env var: flags show up in process listings).")
@click.option("--served-model-name", help="Model id reported by /v1/models (default: the model dir's name).")
@click.option("--max-tokens", type=click.IntRange(min=1), help="Completion budget for requests that set none.")
@click.option("--tool-call-parser", type=click.Choice(["auto", "qwen25", "llama3", "glm45", "none"]), default="auto",
              show_default=True, help="How tool calls are parsed out of replies (SGLang's names; auto: the model "
                                      "family's: qwen25 for Qwen2.5/Qwen3, llama3 for Llama 3.x, glm45 for GLM-4.5).")
@click.option("--reasoning-parser", type=click.Choice(["auto", "qwen3", "none"]), default="auto", show_default=True,
              help="Split <think>...</think> into reasoning_content (auto: qwen3 for Qwen3 models).")
@force_option("Replace an --out file that already holds sessions.")
@click.pass_context
def harness_cmd(ctx: click.Context, run_dir: str | None, engine_urls: tuple[str, ...], model_path: str | None,
                out_path: str, host: str, port: int, api_key: str | None, served_model_name: str | None,
                max_tokens: int | None, tool_call_parser: str, reasoning_parser: str, force: bool) -> None:
    """Serve POST /v1/chat/completions, /v1/responses (OpenAI) and /v1/messages (Anthropic) in
    front of the engines and record, per session, the exact tokens, loss mask (1 on model tokens
    only) and engine log-probs. Prints the OpenAI base URL, then runs until Ctrl-C/SIGTERM. See
    docs/agent-harness.md.

    \b
    Name each episode with the X-Session-Id header (or the body's `user` field, `metadata.user_id`
    on /v1/messages, or the base URL http://HOST:PORT/sessions/ID/v1), then finish it:
      POST /sessions/ID/finish  {"reward": 1.0, "group": "task-7"}
    With -r RUN, POST /publish turns the finished sessions into the run's next rollout.

    \b
    Examples:
      slimectl harness -r runs/a --out runs/a-agent.jsonl
      slimectl harness --engine-url http://127.0.0.1:30000 --model ckpt/hf --out traj.jsonl --port 0
    """
    from functools import partial

    from slimectl.contract.errors import UsageError
    from slimectl.agents.harness import serve_harness
    from slimectl.stages.rollout.importer import import_rollout

    run = cfg = None
    run_path = resolve_run_dir(ctx, run_dir)
    if run_path:
        from slimectl.contract.rundir import RunDir

        run = RunDir.open(run_path)
        cfg = run.config()
    if not engine_urls and run is None:
        raise UsageError("no engines: pass --engine-url URL (repeatable) or -r RUN to use the run's registered engines")
    if model_path is None:
        if cfg is None:
            raise UsageError("pass --model HF_DIR (the model the engines serve), or -r RUN to use the run's model")
        model_path = cfg.model.tokenizer_path or cfg.model.path
    urls = list(engine_urls) or [r.url for r in run.engines.require_live()]
    token = cfg.engine.token() if cfg is not None else None
    publish = partial(import_rollout, run, cfg) if run is not None else None
    serve_harness(urls, model_path, out_path, host=host, port=port, api_key=api_key, publish=publish,
                  engine_token=token or None, served_model_name=served_model_name, default_max_tokens=max_tokens,
                  overwrite=force, announce=lambda url: click.echo(url), tool_call_parser=tool_call_parser,
                  reasoning_parser=reasoning_parser)
