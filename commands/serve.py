"""``slimectl serve``: start inference engines (embedded CPU engine or SGLang) and register them."""

from __future__ import annotations

import click

from slimectl.commands._options import stage_options


@click.command("serve", short_help="Start inference engines (embedded CPU engine or SGLang) and register them.",
               context_settings={"ignore_unknown_options": True, "allow_extra_args": True})
@stage_options
@click.option("--backend", type=click.Choice(["embedded", "sglang", "external"]),
              help="Engine backend (default: the run's engine.backend).")
@click.option("--num-engines", type=click.IntRange(min=1), help="How many engines to start.")
@click.option("--engine-url", "engine_urls", multiple=True, metavar="URL",
              help="Register a server started elsewhere (repeatable; implies --backend external).")
@click.option("--host", help="Interface to bind (default 127.0.0.1: loopback only).")
@click.option("--advertise-host", help="Address other hosts reach the engines at, recorded in RUN/engines/ "
              "(default: --host; for 0.0.0.0 this machine's address).")
@click.option("--port", type=click.IntRange(0, 65535), help="First port (0: pick free ports).")
@click.option("--sglang-python", type=click.Path(dir_okay=False),
              help="Interpreter that has sglang installed (sglang pins its own torch).")
@click.option("--weight-version", type=click.IntRange(min=0), metavar="N",
              help="Start the engines on RUN/weights/N (default: the newest published weights; 0 without "
                   "weights/0: model.path).")
@click.option("--initial", is_flag=True, help="Start the engines on model.path (weight version 0), "
              "even when trained weights are published.")
@click.pass_context
def serve_cmd(ctx: click.Context, run_dir: str | None, overrides: tuple[str, ...], dry_run: bool, backend: str | None,
              num_engines: int | None, engine_urls: tuple[str, ...], host: str | None, advertise_host: str | None,
              port: int | None, sglang_python: str | None, weight_version: int | None, initial: bool) -> None:
    """Start engines, wait until each answers /health_generate, record them in RUN/engines/, print
    their URLs on stdout, and keep them up until Ctrl-C/SIGTERM (then stop them, leaving no orphans).

    The engines start on the newest published RUN/weights/N and are recorded at weight version N
    (model.path at version 0 when none is published); --weight-version N or --initial picks another.

    \b
    Examples:
      slimectl serve -r runs/a                       # embedded engines on CPU
      slimectl serve -r runs/a --weight-version 3    # on RUN/weights/3 (default: the newest)
      slimectl serve -r runs/a --backend sglang --set engine.gpu_ids=[0,1] --num-engines 2
      slimectl serve -r runs/a --engine-url http://10.0.0.5:30000
      SLIMECTL_ENGINE_TOKEN=... slimectl serve -r runs/a --host 0.0.0.0   # reachable from other hosts
      slimectl serve -r runs/a --backend sglang --sglang-context-length 4096 --sglang-enable-dp-attention

    Any --sglang-FLAG [VALUE] is passed to sglang.launch_server as --FLAG [VALUE].
    """
    from slimectl.commands._stage import open_stage
    from slimectl.contract.errors import UsageError
    from slimectl.stages.serve import serve

    if initial and weight_version is not None:
        raise UsageError("--initial and --weight-version both pick the weights to serve; pass one of them")
    sets = list(overrides)
    passthrough = parse_sglang_passthrough(ctx.args)
    if passthrough:
        import json

        sets.append(f"engine.sglang_args={json.dumps(passthrough)}")
    if sglang_python:
        sets.append(f"engine.sglang_python={sglang_python}")
    for key, value in (("backend", backend), ("num_engines", num_engines), ("host", host),
                       ("advertise_host", advertise_host), ("port", port)):
        if value is not None:
            sets.append(f"engine.{key}={value}")
    if engine_urls:
        sets.append("engine.backend=external")
    opened = open_stage(ctx, "serve", run_dir, sets, dry_run)
    if opened is None:
        return
    run, cfg = opened
    from slimectl.orchestration.heal_check import weights_check

    serve(run, cfg, engine_urls, announce=lambda url: click.echo(url),
          weight_version="initial" if initial else weight_version, verify=weights_check(run, cfg))


def parse_sglang_passthrough(args: list[str]) -> dict:
    """``--sglang-context-length 4096 --sglang-enable-dp-attention`` -> {"context_length": 4096, "enable_dp_attention": True}."""
    import yaml

    from slimectl.contract.errors import UsageError

    out: dict = {}
    i = 0
    while i < len(args):
        a = args[i]
        if not a.startswith("--sglang-") or a == "--sglang-":
            raise UsageError(f"unexpected argument {a!r}; only --sglang-FLAG [VALUE] pass-through options are accepted")
        key, _, inline = a[len("--sglang-"):].partition("=")
        key = key.replace("-", "_")
        if inline:
            out[key] = yaml.safe_load(inline)
            i += 1
        elif i + 1 < len(args) and not args[i + 1].startswith("--"):
            out[key] = yaml.safe_load(args[i + 1])
            i += 2
        else:
            out[key] = True
            i += 1
    return out
