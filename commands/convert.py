"""``slimectl convert``: HF checkpoint -> Megatron torch_dist checkpoint."""

from __future__ import annotations

import click

from slimectl.commands._options import force_option, resolve_run_dir, run_dir_option


@click.command("convert", short_help="Convert an HF model to a Megatron torch_dist checkpoint.")
@click.option("--hf", "hf_dir", type=click.Path(file_okay=False),
              help="HF model directory (default with -r: the run's model.path).")
@click.option("--out", "out_dir", type=click.Path(file_okay=False),
              help="Output checkpoint directory (default with -r: RUN/checkpoints/000000).")
@run_dir_option
@click.option("--tp", default=1, show_default=True, type=click.IntRange(min=1), help="Tensor-parallel size.")
@click.option("--pp", default=1, show_default=True, type=click.IntRange(min=1), help="Pipeline-parallel size.")
@click.option("--dtype", type=click.Choice(["fp32", "bf16"]), default="fp32", show_default=True,
              help="Parameter dtype of the checkpoint.")
@force_option("Replace an existing output.")
@click.pass_context
def convert_cmd(ctx: click.Context, hf_dir: str | None, out_dir: str | None, run_dir: str | None, tp: int, pp: int,
                dtype: str, force: bool) -> None:
    """Convert an HF safetensors model (Llama, Qwen2, Qwen3, Qwen3-MoE, GLM-4.5, DeepSeek-V3) to a Megatron torch_dist checkpoint.

    The result loads in Megatron-LM (--ckpt-format torch_dist; tracker "release") and in
    `slimectl train`, at any TP/PP. With --tp/--pp > 1 the command launches tp*pp processes
    with torchrun itself (or runs as one of them when started under torchrun).

    \b
    Examples:
      slimectl convert --hf Qwen2.5-0.5B --out ckpt/qwen --tp 2
      slimectl convert -r runs/a            # the run's model.path -> RUN/checkpoints/000000
    """
    from slimectl.contract.errors import UsageError
    from slimectl.contract.ranks import under_torchrun
    from slimectl.orchestration.torchrun import relaunch_stage
    from slimectl.stages.convert import check_convert_inputs

    run = resolve_run_dir(ctx, run_dir)
    if out_dir is None and run is None:
        raise UsageError("pass --out DIR, or -r RUN to publish into a run directory")
    if out_dir is not None and run is not None and run_dir is None:
        run = None  # an explicit --out wins over a run dir inherited from the root/env
    if hf_dir is None:
        if run is None:
            raise UsageError("pass --hf DIR (the HF model to convert)")
        from slimectl.contract.rundir import RunDir

        hf_dir = RunDir.open(run).config().model.path
    call = dict(hf_dir=str(hf_dir), out_dir=out_dir, tp=tp, pp=pp, dtype=dtype, force=force,
                run_dir=str(run) if out_dir is None else None)
    if tp * pp > 1 and not under_torchrun():
        check_convert_inputs(hf_dir, out_dir, tp, pp, dtype, force, call["run_dir"])
        code = relaunch_stage("convert", tp * pp, None, call)  # every rank: this call
        if code:
            ctx.exit(code)
        return
    convert_here(None, None, **call)


def convert_here(run, cfg, *, hf_dir: str, out_dir: str | None, run_dir: str | None, **kw) -> None:
    """Convert in this process (the only one, or one rank of torchrun's); rank 0 prints the checkpoint's path."""
    from slimectl.contract.ranks import launch_rank
    from slimectl.stages.convert import convert_hf_to_megatron

    result = convert_hf_to_megatron(hf_dir, out_dir, run_dir=run_dir, **kw)
    if launch_rank() == 0:
        click.echo(str(result.out))
